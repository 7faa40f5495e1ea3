"""The caches a sweep compares, each built from one shared prefill.

A sample is prefilled once into a ``DynamicCache`` (full attention, the exact reference); every
configuration then starts from that state, so a sweep costs one prefill per sample:

    DynamicCache prefill --copy-->  dynamic (reference)
                         --update->  quanto / hqq QuantizedCache (what their own prefill stores)
                         --select->  streaming (sink + recent window), snapkv (importance at the
                                     end of prefill; evicted tokens are gone)
                         --wrap--->  kvtier (TieredCache.wrap: the K/V move into the tiers)

Each of these equals a prefill through that cache: QuantizedCache and the eviction anchors
attend with full precision during prefill and store afterwards; kvtier's prefill attends with
SDPA and stores the same K/V, except that an observing policy (h2o, snapkv) also records the
prefill's attention: those configurations are prefilled directly instead (:attr:`CacheSpec.reuses_prefill`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

ANCHOR_KINDS = ("dynamic", "offloaded", "quanto", "hqq", "streaming", "snapkv", "kvpress")
KINDS = ANCHOR_KINDS + ("kvtier",)
_QUANT_KEYS = {"nbits", "q_group_size", "residual_length", "axis_key", "axis_value"}
_QUANT_BITS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}
_DROP_KEYS = {"budget_fraction", "budget_tokens", "sink_tokens", "window_tokens", "pool_kernel"}
_SWEEP_KEYS = {"device_fraction", "hot_fraction", "host_fraction", "streaming"}
# kvpress's presses (kvtier/eval/kvpress_runner.py maps these names to its classes); "none" is its
# pipeline without a press
KVPRESS_PRESSES = ("snapkv", "expected_attention", "kvzip", "streaming_llm", "none")
_KVPRESS_KEYS = {"press", "budget_fraction", "compress_question"}


@dataclass(frozen=True)
class CacheSpec:
    """One configuration of the sweep.

    Attributes:
        name: label in the table and plot.
        kind: ``dynamic`` (the exact reference), ``offloaded`` (DynamicCache with offloading),
            ``quanto``/``hqq`` (transformers' QuantizedCache backends), ``streaming``
            (StreamingLLM: sink + recent window), ``snapkv`` (SnapKV-style drop at the end of
            prefill), ``kvpress`` (one of kvpress's presses, run in its own venv by
            :mod:`kvtier.eval.kvpress_rows`), or ``kvtier``.
        params: for quanto/hqq: ``nbits``, ``q_group_size``, ``residual_length``; for
            streaming/snapkv: ``budget_fraction`` (tokens kept as a fraction of the context) or
            ``budget_tokens``, ``sink_tokens`` (streaming, default 4), ``window_tokens`` (snapkv's
            observation window, default 32); for kvpress: ``press`` (one of
            :data:`KVPRESS_PRESSES`), ``budget_fraction`` (context tokens kept, default 0.03;
            kvpress's ``compression_ratio`` is 1 minus it) and ``compress_question`` (false:
            kvpress's protocol, the question comes after compression; true: the press sees and
            compresses it with the context, as kvtier's rows do); for kvtier: KVTierConfig fields,
            plus three of the sweep's own: ``device_fraction`` (formerly ``hot_fraction``, still
            read) sizes ``device_tokens`` (and, when absent, ``budget_tokens``) as a fraction of the
            context length, ``host_fraction`` sizes ``host_bytes`` as a fraction of the context's
            16-bit KV, and ``streaming = true`` makes sink + recent window fill the whole budget.
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

    @property
    def reuses_prefill(self) -> bool:
        """Whether this configuration can start from the shared DynamicCache prefill exactly."""
        if self.kind in ("offloaded", "kvpress"):
            return False
        if self.kind == "kvtier":
            from kvtier.config import KVTierConfig

            sparse = self.params.get("attention", KVTierConfig.attention) == "sparse"
            return not (sparse and self.params.get("policy", KVTierConfig.policy) in ("h2o", "snapkv"))
        return True

    def check(self, contexts: list[int], model_config=None) -> None:
        """Raise ValueError naming the field when this configuration cannot be built (before
        any model loads: every context is tried with a stand-in model shape)."""
        p = dict(self.params)
        where = f"config {self.name!r}"
        if self.kind in ("quanto", "hqq"):
            extra = sorted(set(p) - _QUANT_KEYS)
            if extra:
                raise ValueError(f"{where}: unknown key(s) {extra} for kind {self.kind!r}; allowed {sorted(_QUANT_KEYS)}")
            if "nbits" in p and p["nbits"] not in _QUANT_BITS[self.kind]:
                raise ValueError(f"{where}: nbits must be one of {_QUANT_BITS[self.kind]} for {self.kind}, got {p['nbits']!r}")
        elif self.kind in ("streaming", "snapkv"):
            extra = sorted(set(p) - _DROP_KEYS)
            if extra:
                raise ValueError(f"{where}: unknown key(s) {extra} for kind {self.kind!r}; allowed {sorted(_DROP_KEYS)}")
            _fraction(where, "budget_fraction", p.get("budget_fraction", 0.03))
            for ctx in contexts:
                _drop_budget(self, ctx)
        elif self.kind == "kvpress":
            extra = sorted(set(p) - _KVPRESS_KEYS)
            if extra:
                raise ValueError(f"{where}: unknown key(s) {extra} for kind 'kvpress'; allowed {sorted(_KVPRESS_KEYS)}")
            if p.get("press") not in KVPRESS_PRESSES:
                raise ValueError(f"{where}: press must be one of {KVPRESS_PRESSES}, got {p.get('press')!r}")
            if p["press"] == "none" and "budget_fraction" in p:
                raise ValueError(f"{where}: press 'none' keeps every token; drop budget_fraction")
            if not isinstance(p.get("compress_question", False), bool):
                raise ValueError(f"{where}: compress_question must be true or false, got {p['compress_question']!r}")
            _fraction(where, "budget_fraction", p.get("budget_fraction", 0.03))
        elif self.kind == "kvtier":
            for key in ("device_fraction", "hot_fraction", "host_fraction"):
                if key in p:
                    _fraction(where, key, p[key])
            for ctx in contexts:
                try:
                    kvtier_config(self, ctx, model_config, disk_path="/nonexistent-check-only")
                except (TypeError, ValueError) as e:
                    raise ValueError(f"{where}: {e}") from None
        elif p:
            raise ValueError(f"{where}: kind {self.kind!r} takes no parameters, got {sorted(p)}")


def _fraction(where: str, key: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
        raise ValueError(f"{where}: {key} must be a fraction in (0, 1], got {v!r}")


def _drop_budget(spec: CacheSpec, context: int) -> int:
    p = spec.params
    budget = p.get("budget_tokens") or max(1, int(p.get("budget_fraction", 0.03) * context))
    # snapkv's observation window shrinks to half a small budget; streaming's sinks do not
    reserved = p.get("sink_tokens", 4) if spec.kind == "streaming" else 1
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= reserved:
        raise ValueError(f"config {spec.name!r}: the budget ({budget!r} tokens at context {context}) must be an "
                         f"integer above {'sink_tokens' if spec.kind == 'streaming' else '1'} ({reserved})")
    return budget


def snapkv_window_tokens(spec: CacheSpec, context: int) -> int:
    """SnapKV's observation window at ``context``: ``window_tokens`` (32), at most half the budget."""
    return max(1, min(spec.params.get("window_tokens", 32), _drop_budget(spec, context) // 2))


def _device_fraction(spec: CacheSpec, p: dict):
    """Pop the L1 share of a kvtier row from ``p``: ``device_fraction``, or its former name
    ``hot_fraction`` (still read, with a DeprecationWarning, so saved row files keep working)."""
    old = p.pop("hot_fraction", None)
    new = p.pop("device_fraction", None)
    if old is None:
        return new
    if new is not None:
        raise ValueError(f"config {spec.name!r}: set device_fraction only (hot_fraction is its former name)")
    warnings.warn(f"config {spec.name!r}: hot_fraction is now device_fraction (the L1 share of the context)",
                  DeprecationWarning, stacklevel=3)
    return old


def kvtier_config(spec: CacheSpec, context: int, model_config=None, disk_path: str | None = None):
    """The KVTierConfig of a kvtier row at ``context`` tokens (sweep fractions resolved)."""
    from kvtier.config import KVTierConfig, default_block_tokens

    p = dict(spec.params)
    device_fraction = _device_fraction(spec, p)
    host_fraction = p.pop("host_fraction", None)
    streaming = p.pop("streaming", False)
    block = p.get("block_tokens") or default_block_tokens(p.get("attention", KVTierConfig.attention))
    if host_fraction is not None:
        # L2 sized as a fraction of the context's KV at 16 bits: the rest spills to L3
        per_token = _kv_bytes_per_token(model_config) if model_config is not None else 2 * 30 * 3 * 64 * 2
        p["host_bytes"] = max(1 << 20, int(host_fraction * context * per_token))
    if device_fraction is not None:
        l1 = max(block, int(device_fraction * context) // block * block)
        p["device_tokens"] = l1
        p.setdefault("budget_tokens", l1)
    if streaming:
        # StreamingLLM inside kvtier: one sink block and a recent window fill the whole budget,
        # so no evicted block is ever selected again (the contrast to kvtier's recall)
        budget = p.get("budget_tokens") or p["device_tokens"]
        p["sink_tokens"] = block
        p["window_tokens"] = max(0, budget - 2 * block)
    if p.get("disk_path", "auto") == "auto":
        p["disk_path"] = disk_path
    return KVTierConfig(**p)


def _kv_bytes_per_token(c) -> int:
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * hd * 2


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


@dataclass
class Prefill:
    """One sample's shared prefill: full-attention K/V per layer and what anchors need of it."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [1, kv_heads, T, head_dim] each
    logits: torch.Tensor                         # [vocab] float32, predicting token T
    seconds: float
    queries: list[torch.Tensor] | None = None    # per layer: [1, heads, w, head_dim] (snapkv)

    @property
    def tokens(self) -> int:
        return self.kv[0][0].shape[-2]


class QueryTap:
    """Captures each attention layer's last ``w`` queries (after RoPE) during a prefill: what
    SnapKV scores the prefix with. Hooks are removed by :meth:`close`."""

    def __init__(self, model, w: int):
        self.w = w
        self.queries: dict[int, torch.Tensor] = {}
        self._hooks = []
        for i, layer in enumerate(model.model.layers):
            self._hooks.append(layer.self_attn.register_forward_pre_hook(self._hook(i), with_kwargs=True))

    def _hook(self, i: int):
        def pre(module, args, kwargs):
            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

            h = kwargs.get("hidden_states", args[0] if args else None)[:, -self.w:]  # [1, w, hidden]
            cos, sin = kwargs["position_embeddings"]
            hd = module.head_dim
            q = module.q_proj(h).view(h.shape[0], h.shape[1], -1, hd).transpose(1, 2)  # [1, heads, w, hd]
            q, _ = apply_rotary_pos_emb(q, q, cos[:, -self.w:], sin[:, -self.w:])
            self.queries[i] = q
        return pre

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


KEPT_QUERIES = 32  # queries a kept prefill holds: snapkv's default observation window


@torch.inference_mode()
def prefill(model, ids: torch.Tensor, snapkv_window: int = 0, cache_dir: Path | None = None) -> Prefill:
    """Prefill ``ids`` ([T]) once into a DynamicCache. Only the last position's logits are
    computed (``logits_to_keep=1``: a 16k prefill would otherwise materialise GBs of logits).

    With ``cache_dir``, the result is kept there as a safetensors file keyed by the model, its
    dtype and the token ids, and read back instead of recomputed: a 32k prefill costs tens of
    CPU-minutes and is the same for every rerun of a sample. ``seconds`` is then the time the
    prefill took when it was computed. A kept prefill holds the queries of a window of at least
    :data:`KEPT_QUERIES` (so runs with and without a snapkv row share it).
    """
    from transformers import DynamicCache

    path = None
    if cache_dir is not None:
        path = _prefill_path(model, ids, cache_dir)
        kept = _read_prefill(path, model.config.num_hidden_layers, ids.numel()) if path.is_file() else None
        if kept is not None and (not snapkv_window or (kept.queries is not None
                                                      and kept.queries[0].shape[-2] >= snapkv_window)):
            return kept
        snapkv_window = max(snapkv_window, KEPT_QUERIES)
    cache = DynamicCache(config=model.config)
    tap = QueryTap(model, snapkv_window) if snapkv_window else None
    try:
        t0 = time.perf_counter()
        out = model(input_ids=ids.view(1, -1), cache=cache, use_cache=True, logits_to_keep=1)
        seconds = time.perf_counter() - t0
    finally:
        if tap is not None:
            tap.close()
    kv = [(ly.keys, ly.values) for ly in cache.layers]
    queries = [tap.queries[i] for i in range(len(kv))] if tap is not None else None
    pre = Prefill(kv, out.logits[0, -1].float(), seconds, queries)
    if path is not None:
        _write_prefill(pre, path)
    return pre


def _prefill_path(model, ids: torch.Tensor, cache_dir: Path) -> Path:
    c = model.config
    h = hashlib.sha256()
    h.update(json.dumps([getattr(c, "_name_or_path", ""), c.model_type, c.num_hidden_layers, c.hidden_size,
                         str(next(model.parameters()).dtype), ids.numel()]).encode())
    h.update(ids.to(torch.int64).contiguous().numpy().tobytes())
    return Path(cache_dir) / f"prefill-{ids.numel()}-{h.hexdigest()[:24]}.safetensors"


def _write_prefill(pre: Prefill, path: Path) -> None:
    from safetensors.torch import save

    tensors = {"logits": pre.logits.contiguous()}
    for l, (k, v) in enumerate(pre.kv):
        tensors[f"k.{l}"], tensors[f"v.{l}"] = k.contiguous(), v.contiguous()
        if pre.queries is not None:
            tensors[f"q.{l}"] = pre.queries[l].contiguous()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    data = save(tensors, metadata={"seconds": repr(pre.seconds), "layers": str(len(pre.kv))})
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # owner-only from the start
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _read_prefill(path: Path, layers: int, tokens: int) -> Prefill | None:
    """A kept prefill, or None when the file is unreadable or does not hold ``layers`` layers of
    ``tokens`` tokens (it is then recomputed)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        t = load_file(str(path))
        if int(meta.get("layers", -1)) != layers:
            return None
        kv = [(t[f"k.{l}"], t[f"v.{l}"]) for l in range(layers)]
        if any(k.shape[-2] != tokens or v.shape[-2] != tokens for k, v in kv):
            return None
        queries = [t[f"q.{l}"] for l in range(layers)] if "q.0" in t else None
        return Prefill(kv, t["logits"], float(meta["seconds"]), queries)
    except (OSError, KeyError, ValueError, SafetensorError):
        return None


def _dynamic_from(model, kv) -> "DynamicCache":  # noqa: F821
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for l, (k, v) in enumerate(kv):
        cache.update(k, v, l)  # copies: the shared prefill stays untouched
    return cache


def snapkv_keep(keys: torch.Tensor, queries: torch.Tensor, budget: int, window: int, kernel: int = 7) -> torch.Tensor:
    """SnapKV's selection for one layer: per KV head, the ``budget - window`` prefix tokens the
    last ``window`` queries attend to most (pooled over ``kernel`` neighbours), plus the window.

    Args:
        keys: [1, kv_heads, T, hd]; queries: [1, heads, window, hd].
    Returns:
        LongTensor [kv_heads, budget] of kept token indices, ascending.
    """
    _, kvh, t, hd = keys.shape
    heads = queries.shape[1]
    group = heads // kvh
    q = queries[0].float().reshape(kvh, group * window, hd)               # [kv_heads, g*w, hd]
    logits = q @ keys[0].float().transpose(1, 2) / math.sqrt(hd)        # [kv_heads, g*w, T]
    qpos = torch.arange(t - window, t).repeat(group)                    # [g*w] causal mask
    logits.masked_fill_(torch.arange(t)[None, :] > qpos[:, None], float("-inf"))
    score = logits.softmax(-1)[:, :, : t - window].sum(1)              # [kv_heads, T - w]
    score = torch.nn.functional.max_pool1d(score[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    top = score.topk(budget - window, dim=-1).indices                  # [kv_heads, budget - w]
    tail = torch.arange(t - window, t).expand(kvh, window)
    return torch.cat([top, tail], dim=-1).sort(dim=-1).values


class Run:
    """One configuration's cache for one sample, built from the shared prefill, and what it
    needs after each decode step (the StreamingLLM window slides) and at the end."""

    def __init__(self, spec: CacheSpec, model, pre: Prefill | None, context: int, workdir: Path):
        self.spec = spec
        self.model = model
        self.build_s = 0.0
        self._tmp: Path | None = None
        self._attn_before = model.config._attn_implementation
        self._sink = self._window = 0
        self.cache = None
        t0 = time.perf_counter()
        try:
            self._build(spec, model, pre, context, workdir)
        except BaseException:
            self.close()  # nothing left behind: attention restored, L3 directory removed
            raise
        self.build_s = time.perf_counter() - t0

    def _build(self, spec: CacheSpec, model, pre: Prefill | None, context: int, workdir: Path) -> None:
        from transformers import QuantizedCache

        p = dict(spec.params)
        assert spec.kind != "kvpress", "kvpress rows run in their own venv (kvpress_rows.run), not here"
        if spec.kind == "offloaded":
            # transformers' offloading moves layers between a CUDA device and the CPU on side
            # streams; on a CPU-only machine there is nothing to offload to.
            if not torch.cuda.is_available():
                raise Unavailable("DynamicCache offloading needs CUDA")
            from transformers import DynamicCache

            self.cache = DynamicCache(config=model.config, offloading=True)
        elif spec.kind == "dynamic":
            self.cache = _dynamic_from(model, pre.kv)
        elif spec.kind in ("quanto", "hqq"):
            self.cache = QuantizedCache(spec.kind, model.config, **p)
            for l, (k, v) in enumerate(pre.kv):
                self.cache.update(k, v, l)  # what their prefill stores: quantized, plus the residual
        elif spec.kind == "streaming":
            budget = _drop_budget(spec, context)
            self._sink = p.get("sink_tokens", 4)
            self._window = budget - self._sink
            t = pre.tokens
            keep = torch.cat([torch.arange(min(self._sink, t)), torch.arange(max(self._sink, t - self._window), t)])
            self.cache = _dynamic_from(model, [(k[:, :, keep], v[:, :, keep]) for k, v in pre.kv])
        elif spec.kind == "snapkv":
            budget = _drop_budget(spec, context)
            window = snapkv_window_tokens(spec, context)
            kept = []
            for (k, v), q in zip(pre.kv, pre.queries):
                if budget >= k.shape[-2]:
                    kept.append((k, v))
                    continue
                idx = snapkv_keep(k, q[:, :, -window:], budget, window, p.get("pool_kernel", 7))  # [kv_heads, budget]
                gi = idx[None, :, :, None].expand(1, -1, -1, k.shape[-1])
                kept.append((k.gather(2, gi), v.gather(2, gi)))
            self.cache = _dynamic_from(model, kept)
        else:
            from kvtier.hf.cache import TieredCache

            self._tmp = Path(tempfile.mkdtemp(prefix="l3-", dir=workdir))
            cfg = kvtier_config(spec, context, model.config, disk_path=str(self._tmp))
            if pre is not None and spec.reuses_prefill:
                self.cache = TieredCache.wrap(_dynamic_from(model, pre.kv), cfg, model)
            else:
                self.cache = TieredCache(cfg, model)

    def after_step(self) -> None:
        """StreamingLLM: keep the sinks and the most recent ``window`` tokens."""
        if self.spec.kind != "streaming":
            return
        for ly in self.cache.layers:
            t = ly.keys.shape[-2]
            if t > self._sink + self._window:
                ly.keys = torch.cat([ly.keys[:, :, : self._sink], ly.keys[:, :, t - self._window:]], dim=2)
                ly.values = torch.cat([ly.values[:, :, : self._sink], ly.values[:, :, t - self._window:]], dim=2)

    def settle(self) -> None:
        """Wait for the store's queued swap-outs. Until a block's swap-out is done, a read still
        finds its full-precision copy, so without this which blocks a step reads encoded would
        depend on thread timing and a rerun with the same seed could give other figures. Called
        outside the timed steps."""
        if self.spec.kind == "kvtier":
            self.cache.store.flush()

    def footprint(self, tokens: int) -> dict:
        """Bytes per token per tier. Anchors hold everything in 'L1' (the model's device)."""
        if self.spec.kind != "kvtier":
            b = anchor_bytes(self.cache)
            return {"l1_bytes_per_token": b / tokens, "l2_bytes_per_token": 0.0, "l3_bytes_per_token": 0.0,
                    "total_bytes_per_token": b / tokens, "peak_l1_bytes": b}
        return footprint_from_stats(self.cache.stats(), tokens)

    def stats(self) -> dict:
        return self.cache.stats() if self.spec.kind == "kvtier" else {}

    def close(self) -> None:
        if self.spec.kind == "kvtier" and self.cache is not None:
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


