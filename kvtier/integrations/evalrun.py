"""Runs one cache configuration over token windows the way generation does, for `kvtier eval`.

Each window is prefilled through the cache under test, then its continuation is fed one token at
a time through the decode path (teacher forcing), so quantization and tier moves happen exactly
as in ``generate()``. The reference is a plain ``DynamicCache`` on the same windows.
"""
from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvtier.eval.data import Window

ANCHOR_KINDS = ("dynamic", "offloaded", "quanto", "hqq")
KINDS = ANCHOR_KINDS + ("kvtier",)


@dataclass(frozen=True)
class CacheSpec:
    """One configuration of the sweep.

    Attributes:
        name: label in the table and plot.
        kind: ``dynamic`` (the exact reference), ``offloaded`` (DynamicCache with offloading),
            ``quanto``/``hqq`` (transformers' QuantizedCache backends), or ``kvtier``.
        params: for quanto/hqq: ``nbits``, ``q_group_size``, ``residual_length``; for kvtier:
            KVTierConfig fields, plus three of the sweep's own: ``hot_fraction`` sizes ``hot_tokens``
            (and, when absent, ``budget_tokens``) as a fraction of the context length,
            ``host_fraction`` sizes ``host_bytes`` as a fraction of the context's 16-bit KV, and
            ``streaming = true`` makes sink + recent window fill the whole budget (StreamingLLM).
    """

    name: str
    kind: str
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"config {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def anchor(self) -> bool:
        return self.kind in ANCHOR_KINDS


def tensor_bytes(obj, _seen=None) -> int:
    """Bytes held by tensors reachable from ``obj`` (tensor subclasses counted by their inner tensors)."""
    seen = _seen if _seen is not None else set()
    if isinstance(obj, torch.Tensor):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, n), seen) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o, seen) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o, seen) for o in obj.values())
    return 0


def anchor_bytes(cache) -> int:
    """Bytes of KV an anchor (transformers) cache holds, quantized parts and residual included."""
    total = 0
    seen: set = set()
    for layer in cache.layers:
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            total += tensor_bytes(getattr(layer, name, None), seen)
    return total


class Unavailable(RuntimeError):
    """A configuration that cannot run on this machine (reported as skipped, not failed)."""


class _Run:
    """A cache under test plus what it needs cleaned up afterwards."""

    def __init__(self, spec: CacheSpec, model, context: int, workdir: Path):
        from transformers import DynamicCache, QuantizedCache

        self.spec = spec
        self.model = model
        self._tmp: Path | None = None
        self._attn_before = model.config._attn_implementation
        p = dict(spec.params)
        if spec.kind == "dynamic":
            self.cache = DynamicCache(config=model.config)
        elif spec.kind == "offloaded":
            # transformers' offloading moves layers between a CUDA device and the CPU on side
            # streams; on a CPU-only machine there is nothing to offload to.
            if not torch.cuda.is_available():
                raise Unavailable("DynamicCache offloading needs CUDA")
            self.cache = DynamicCache(config=model.config, offloading=True)
        elif spec.kind in ("quanto", "hqq"):
            self.cache = QuantizedCache(spec.kind, model.config, **p)
        else:
            import kvtier
            from kvtier.config import KVTierConfig

            hot_fraction = p.pop("hot_fraction", None)
            host_fraction = p.pop("host_fraction", None)
            streaming = p.pop("streaming", False)
            block = p.get("block_tokens", KVTierConfig.block_tokens)
            if host_fraction is not None:
                # L2 sized as a fraction of the context's KV at 16 bits: with a quantized L2 most
                # evicted blocks stay in DRAM and the rest spill to L3, so every tier is exercised
                c = model.config
                hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
                per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * hd * 2
                p["host_bytes"] = max(1 << 20, int(host_fraction * context * per_token))
            if hot_fraction is not None:
                hot = max(block, int(hot_fraction * context) // block * block)
                p["hot_tokens"] = hot
                p.setdefault("budget_tokens", hot)
            if streaming:
                # StreamingLLM: one sink block and a recent window fill the whole budget, so no
                # evicted block is ever selected again (the contrast to kvtier's recall).
                budget = p.get("budget_tokens") or p["hot_tokens"]
                p["sink_tokens"] = block
                p["window_tokens"] = max(0, budget - 2 * block)
            if p.get("disk_path", "auto") == "auto":
                self._tmp = Path(tempfile.mkdtemp(prefix="l3-", dir=workdir))
                p["disk_path"] = str(self._tmp)
            self.cache = kvtier.attach(model, KVTierConfig(**p))

    def footprint(self, tokens: int) -> dict:
        """Bytes per token per tier. Anchors hold everything in 'L1' (the model's device)."""
        if self.spec.kind != "kvtier":
            b = anchor_bytes(self.cache)
            return {"l1_bytes_per_token": b / tokens, "l2_bytes_per_token": 0.0, "l3_bytes_per_token": 0.0,
                    "total_bytes_per_token": b / tokens, "peak_l1_bytes": b}
        st = self.cache.stats()
        return footprint_from_stats(st, tokens)

    def stats(self) -> dict:
        return self.cache.stats() if self.spec.kind == "kvtier" else {}

    def close(self) -> None:
        if self.spec.kind == "kvtier":
            with contextlib.suppress(AttributeError):
                self.cache.close()
        self.model.config._attn_implementation = self._attn_before
        with contextlib.suppress(AttributeError):
            self.model.set_attn_implementation(self._attn_before)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


def footprint_from_stats(st: dict, tokens: int) -> dict:
    """Bytes per token per tier from a kvtier ``stats()`` dict.

    Every copy a tier holds counts (a block swapped back into L1 keeps its valid L2/L3 copies),
    so the total is the memory the configuration really occupies.
    """
    b = {t: float(st["bytes"].get(t, 0)) for t in ("l1", "l2", "l3")}
    return {
        "l1_bytes_per_token": b["l1"] / tokens,
        "l2_bytes_per_token": b["l2"] / tokens,
        "l3_bytes_per_token": b["l3"] / tokens,
        "total_bytes_per_token": sum(b.values()) / tokens,
        "peak_l1_bytes": float(st.get("peak_bytes", {}).get("l1", b["l1"])),
    }


@torch.inference_mode()
def warm_up(model, tokens: int = 64) -> None:
    """One short prefill and a few decode steps, so the first measured configuration does not pay
    for allocator and kernel warm-up."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.arange(100, 100 + tokens).view(1, -1)
    model(input_ids=ids, cache=cache, use_cache=True)
    for t in range(4):
        model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)


@torch.inference_mode()
def run_window(model, window: Window, spec: CacheSpec, workdir: Path) -> dict:
    """Prefill ``window.context`` then teacher-force ``window.continuation``.

    Returns a dict with ``logp`` ([M, vocab] float32 log-probabilities predicting each continuation
    token), ``step_s`` (decode step times), ``prefill_s``, ``footprint`` and kvtier ``stats``.
    """
    ctx = window.context.view(1, -1)
    cont = window.continuation.view(1, -1)
    run = _Run(spec, model, ctx.shape[1], workdir)
    try:
        t0 = time.perf_counter()
        out = model(input_ids=ctx, cache=run.cache, use_cache=True)
        prefill_s = time.perf_counter() - t0
        logits = [out.logits[0, -1].float()]
        steps = []
        for t in range(cont.shape[1] - 1):
            t0 = time.perf_counter()
            out = model(input_ids=cont[:, t:t + 1], cache=run.cache, use_cache=True)
            steps.append(time.perf_counter() - t0)
            logits.append(out.logits[0, -1].float())
        tokens = ctx.shape[1] + cont.shape[1] - 1
        result = {
            "logp": torch.log_softmax(torch.stack(logits), dim=-1),
            "step_s": steps,
            "prefill_s": prefill_s,
            "footprint": run.footprint(tokens),
            "stats": run.stats(),
        }
    finally:
        run.close()
    return result
