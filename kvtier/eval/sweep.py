"""The sweep: which configurations `kvtier eval` compares, and the loop that measures them.

Configurations come from the built-in lists below or from a TOML file::

    [[config]]
    name = "int4-sparse-25"
    kind = "kvtier"            # dynamic | offloaded | quanto | hqq | kvtier
    codec = "int4"             # any other key is passed on (KVTierConfig fields for kvtier,
    attention = "sparse"       # nbits / q_group_size / residual_length for quanto and hqq)
    hot_fraction = 0.25        # kvtier: L1 (hot_tokens) as a fraction of the context

The first configuration whose kind is ``dynamic`` is the reference; one is added if none is given.
"""
from __future__ import annotations

import math
import statistics
import tomllib
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.eval import metrics
from kvtier.eval.data import Window
from kvtier.integrations.evalrun import KINDS, CacheSpec, Unavailable, run_window

REFERENCE = CacheSpec("dynamic (ref)", "dynamic")


def _kv(name: str, **params) -> CacheSpec:
    # sparse: 16-token blocks, finer selection (at 1k-4k contexts 32-token blocks lost much of the
    # recall probe at the same budget); dense: 64-token blocks, since every step swaps in every
    # block outside L1 and the per-block cost dominates (int8, 4k, L1 25%: 0.9 tok/s at 16 tokens),
    # and keys' per-channel groups span the block. L2 holds a quarter of the context's 16-bit KV.
    params.setdefault("block_tokens", 16 if params.get("attention") == "sparse" else 64)
    params.setdefault("host_fraction", 0.25)
    params.setdefault("write_through", False)  # measure tiering alone, no prefix-sharing copies
    return CacheSpec(name, "kvtier", params)


def quick_configs() -> list[CacheSpec]:
    return [
        REFERENCE,
        CacheSpec("quanto int4", "quanto", {"nbits": 4}),
        CacheSpec("hqq int4", "hqq", {"nbits": 4}),
        _kv("kvtier int8 dense L1=25%", codec="int8", attention="dense", hot_fraction=0.25, policy="lru"),
        _kv("kvtier int4 dense L1=25%", codec="int4", attention="dense", hot_fraction=0.25, policy="lru"),
        _kv("kvtier int4 sparse L1=25%", codec="int4", attention="sparse", hot_fraction=0.25, policy="h2o"),
        _kv("kvtier int4 sparse L1=10%", codec="int4", attention="sparse", hot_fraction=0.10, policy="h2o"),
        # one key centroid per 4 tokens instead of per 16-token block: 4x the digest bytes, for
        # the recall probe at long context (one matching key is not averaged away by 15 others)
        _kv("kvtier int4 sparse L1=10% c4", codec="int4", attention="sparse", hot_fraction=0.10, policy="h2o",
            digest_tokens=4),
        _kv("kvtier int4 t2c sparse L1=25%", codec="int4", order="tier-then-compress", attention="sparse",
            hot_fraction=0.25, policy="h2o"),
        _kv("sink-window int4 (no recall)", codec="int4", attention="sparse", hot_fraction=0.10,
            policy="sink-window", streaming=True),
        # bytes-lean: 64-token blocks so keys' per-channel groups span 64 tokens (in 16-token
        # blocks they span 16 and scales cost ~4x more), L1 = the open block only, and zstd on the
        # L2/L3 records (entropy coding of the 4-bit codes: ~5% fewer bytes; lz4 finds nothing),
        # kept when it saves 2% (at the default 5% margin most int4 records would stay raw)
        _kv("kvtier int4 g64 zstd dense L1=64 tok", codec="int4", group_size=64, attention="dense",
            hot_tokens=64, policy="lru", byte_stage="zstd", byte_stage_l2=True, lz4_min_saving=0.02),
    ]


def full_configs() -> list[CacheSpec]:
    out = quick_configs()
    out[3:3] = [
        CacheSpec("quanto int2", "quanto", {"nbits": 2}),
        CacheSpec("hqq int8", "hqq", {"nbits": 8}),
        CacheSpec("dynamic offloaded", "offloaded"),
    ]
    for codec in ("int2", "nf4"):
        out.append(_kv(f"kvtier {codec} sparse L1=25%", codec=codec, attention="sparse", hot_fraction=0.25,
                       policy="h2o"))
    for policy in ("lru", "snapkv"):
        out.append(_kv(f"kvtier int4 sparse {policy} L1=25%", codec="int4", attention="sparse",
                       hot_fraction=0.25, policy=policy))
    out.append(_kv("kvtier int8 sparse L1=50%", codec="int8", attention="sparse", hot_fraction=0.5, policy="h2o"))
    out.append(_kv("kvtier int8 t2c dense L1=10%", codec="int8", order="tier-then-compress", attention="dense",
                   hot_fraction=0.10, policy="lru"))
    return out


def load_configs(path: str | Path) -> list[CacheSpec]:
    """Parse a TOML sweep file (see module docstring). Raises ValueError on bad entries."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"--configs {path}: cannot read TOML: {e}") from e
    entries = data.get("config")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"--configs {path}: expected one or more [[config]] tables")
    specs = []
    for i, e in enumerate(entries):
        e = dict(e)
        name = e.pop("name", None)
        kind = e.pop("kind", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"--configs {path}: config #{i} needs a non-empty string 'name'")
        if kind not in KINDS:
            raise ValueError(f"--configs {path}: config {name!r}: 'kind' must be one of {KINDS}, got {kind!r}")
        specs.append(CacheSpec(name, kind, e))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"--configs {path}: config names must be unique, got {names}")
    return specs


def with_reference(specs: list[CacheSpec]) -> tuple[CacheSpec, list[CacheSpec]]:
    ref = next((s for s in specs if s.kind == "dynamic"), None)
    if ref is None:
        return REFERENCE, specs
    return ref, [s for s in specs if s is not ref]


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


@dataclass
class WindowResult:
    window: Window
    logp: torch.Tensor
    step_s: list
    prefill_s: float
    footprint: dict
    stats: dict


def measure(model, spec: CacheSpec, windows: list[Window], workdir: Path, on_window=None) -> list[WindowResult]:
    out = []
    for w in windows:
        r = run_window(model, w, spec, workdir)
        out.append(WindowResult(w, r["logp"], r["step_s"], r["prefill_s"], r["footprint"], r["stats"]))
        if on_window:
            on_window()
    return out


def summarise(spec: CacheSpec, context: int, ref: list[WindowResult], got: list[WindowResult]) -> dict:
    """One row of the results: accuracy against ``ref`` on the same windows, footprint, cost."""
    text = [(r, g) for r, g in zip(ref, got) if r.window.kind == "text"]
    probe = [(r, g) for r, g in zip(ref, got) if r.window.kind == "probe"]
    acc: dict = {}
    if text:
        ref_lp = torch.cat([r.logp for r, _ in text])
        lp = torch.cat([g.logp for _, g in text])
        targets = torch.cat([r.window.continuation for r, _ in text])
        acc.update(metrics.compare(ref_lp, lp, targets))
    if probe:
        pa = statistics.fmean(metrics.top1_accuracy(g.logp, g.window.continuation) for _, g in probe)
        pr = statistics.fmean(metrics.top1_accuracy(r.logp, r.window.continuation) for r, _ in probe)
        acc.update({"probe_acc": pa, "probe_acc_ref": pr, "probe_rel": pa / pr if pr > 0 else float("nan")})
    fp_keys = got[0].footprint.keys()
    footprint = {k: statistics.fmean(g.footprint[k] for g in got) for k in fp_keys}
    steps = [s for g in got for s in g.step_s]
    cost = {
        "decode_tok_s": len(steps) / sum(steps) if steps else float("nan"),
        "tpot_p50_ms": 1e3 * _pct(steps, 0.50),
        "tpot_p99_ms": 1e3 * _pct(steps, 0.99),
        "prefill_s": statistics.fmean(g.prefill_s for g in got),
    }
    st = got[-1].stats
    if st:
        cost.update(_stats_cost(st, context + len(got[-1].window.continuation)))
        footprint["compression"] = st.get("compression", {})
    return {"config": spec.name, "kind": spec.kind, "anchor": spec.anchor, "params": dict(spec.params),
            "context": context, "accuracy": acc, "footprint": footprint, "cost": cost, "stats": st}


def _stats_cost(st: dict, tokens: int) -> dict:
    swapped = sum(st.get("swap_in_bytes", {}).values()) + sum(st.get("swap_out_bytes", {}).values())
    pf = st.get("prefetch", {})
    return {
        "swap_bytes_per_token": swapped / tokens,
        "prefetch_precision": pf.get("precision"),
        "prefetch_coverage": pf.get("coverage"),
    }
