"""The sweep: which configurations `kvtier eval` compares, and the loop that measures them.

Configurations come from the built-in lists below or from a TOML file::

    [[config]]
    name = "int4-sparse-25"
    kind = "kvtier"            # dynamic | offloaded | quanto | hqq | streaming | snapkv | kvtier
    codec = "int4"             # any other key is passed on (KVTierConfig fields for kvtier,
    attention = "sparse"       # nbits / q_group_size / residual_length for quanto and hqq)
    device_fraction = 0.25     # kvtier: L1 (device_tokens) as a fraction of the context

The first configuration whose kind is ``dynamic`` is the reference; one is added if none is given.
Every configuration is checked (:meth:`CacheSpec.check`) before any model loads.

:func:`summarise` turns one configuration's results into a row: every accuracy figure with its
95% bootstrap interval over samples, and the paired difference against the reference.
"""
from __future__ import annotations

import math
import statistics
import tomllib
from pathlib import Path

import torch

from kvtier.config import default_block_tokens
from kvtier.eval import metrics
from kvtier.eval.caches import KINDS, CacheSpec
from kvtier.eval.runner import Result

REFERENCE = CacheSpec("dynamic (ref)", "dynamic")


def _kv(name: str, **params) -> CacheSpec:
    # sparse: 16-token blocks, finer selection (at 1k-4k contexts 32-token blocks lost much of the
    # recall probe at the same budget); dense: 64-token blocks, since every step swaps in every
    # block outside L1 and the per-block cost dominates (int8, 4k, L1 25%: 0.9 tok/s at 16 tokens),
    # and keys' per-channel groups span the block. L2 holds a quarter of the context's 16-bit KV.
    params.setdefault("block_tokens", default_block_tokens(params.get("attention", "dense")))
    params.setdefault("host_fraction", 0.25)
    params.setdefault("write_through", False)  # measure tiering alone, no prefix-sharing copies
    return CacheSpec(name, "kvtier", params)


def quick_configs() -> list[CacheSpec]:
    return [
        REFERENCE,
        CacheSpec("quanto int4", "quanto", {"nbits": 4}),
        CacheSpec("hqq int4", "hqq", {"nbits": 4}),
        _kv("kvtier int8 dense L1=25%", codec="int8", attention="dense", device_fraction=0.25, policy="lru"),
        _kv("kvtier int4 dense L1=25%", codec="int4", attention="dense", device_fraction=0.25, policy="lru"),
        _kv("kvtier int4 sparse L1=25%", codec="int4", attention="sparse", device_fraction=0.25, policy="h2o"),
        _kv("kvtier int4 sparse L1=10%", codec="int4", attention="sparse", device_fraction=0.10, policy="h2o"),
        # one bf16 key centroid per 16-token block instead of the default key row per token (4 bits
        # per channel): about 0.17x the key digest bytes at head_dim 64 (8 against 48 B/token a kv
        # head), and a matching key averaged away by 15 others
        _kv("kvtier int4 sparse L1=10% d16", codec="int4", attention="sparse", device_fraction=0.10, policy="h2o",
            digest_tokens=16, digest_dtype="kv"),
        _kv("kvtier int4 t2c sparse L1=25%", codec="int4", order="tier-then-compress", attention="sparse",
            device_fraction=0.25, policy="h2o"),
        _kv("sink-window int4 (no recall)", codec="int4", attention="sparse", device_fraction=0.10,
            policy="sink-window", streaming=True),
        # bytes-lean: 64-token blocks so keys' per-channel groups span 64 tokens (in 16-token
        # blocks they span 16 and scales cost ~4x more), L1 = the open block only, and zstd on the
        # L2/L3 records (entropy coding of the 4-bit codes: ~5% fewer bytes; lz4 finds nothing),
        # kept when it saves 2% (at the default 5% margin most int4 records would stay raw)
        _kv("kvtier int4 g64 zstd dense L1=64 tok", codec="int4", group_size=64, attention="dense",
            device_tokens=64, policy="lru", byte_stage="zstd", byte_stage_l2=True, byte_stage_min_saving=0.02),
    ]


SPARSE_L1 = (0.015, 0.03, 0.06, 0.125)


def ruler_configs(l1_fractions=SPARSE_L1) -> list[CacheSpec]:
    """The long-context sweep: full attention, eviction-only anchors at kvtier's smallest
    sparse budget but one (3%), transformers' quantized caches, and kvtier int4 sparse at each
    L1 fraction with a small L2 (2% of the 16-bit KV), so most blocks live on L3 and come back
    by query, with the default key digest (a row per token, 4 bits per channel) and, at 3%, one
    centroid per 16-token block in the KV dtype (``d16``) to show what the finer digest buys;
    plus kvtier int4 dense.

    The sparse rows use the lru policy: blocks are selected by query at every step wherever they
    lie, so the policy only decides which tier holds them, and a non-observing policy lets the
    row start from the shared prefill exactly.
    """
    out = [REFERENCE]
    for f in (0.03,):
        out.append(CacheSpec(f"StreamingLLM {f:.1%}", "streaming", {"budget_fraction": f}))
        out.append(CacheSpec(f"SnapKV drop {f:.1%}", "snapkv", {"budget_fraction": f}))
    out.append(CacheSpec("quanto int4", "quanto", {"nbits": 4}))
    out.append(CacheSpec("quanto int2", "quanto", {"nbits": 2}))
    for f in l1_fractions:
        out.append(_kv(f"kvtier int4 sparse L1={f:.1%}", codec="int4", attention="sparse", device_fraction=f,
                       host_fraction=0.02, policy="lru"))
    # one centroid per 16-token block: a needle that straddles two blocks is a few tokens of
    # each, averaged away among 16 (RULER niah_single_2 at 32k: the 16-token digest read 4 of its
    # 7 digits at L1 = 3% and 6 at 12.5%; per 4 tokens, all 7 at 3%)
    out.append(_kv("kvtier int4 sparse L1=3.0% d16", codec="int4", attention="sparse", device_fraction=0.03,
                   host_fraction=0.02, policy="lru", digest_tokens=16, digest_dtype="kv"))
    out.append(_kv("kvtier int4 dense", codec="int4", attention="dense", device_fraction=0.03, host_fraction=0.02,
                   policy="lru"))
    return out


def demo_configs() -> list[CacheSpec]:
    """`make demo`: full attention, StreamingLLM and kvtier sparse (the default digest) at the
    same 3% budget."""
    keep = ("dynamic (ref)", "StreamingLLM 3.0%", "kvtier int4 sparse L1=3.0%")
    return [s for s in ruler_configs() if s.name in keep]


def full_configs() -> list[CacheSpec]:
    out = quick_configs()
    out[3:3] = [
        CacheSpec("quanto int2", "quanto", {"nbits": 2}),
        CacheSpec("hqq int8", "hqq", {"nbits": 8}),
        CacheSpec("dynamic offloaded", "offloaded"),
    ]
    for codec in ("int2", "nf4"):
        out.append(_kv(f"kvtier {codec} sparse L1=25%", codec=codec, attention="sparse", device_fraction=0.25,
                       policy="h2o"))
    for policy in ("lru", "snapkv"):
        out.append(_kv(f"kvtier int4 sparse {policy} L1=25%", codec="int4", attention="sparse",
                       device_fraction=0.25, policy=policy))
    out.append(_kv("kvtier int8 sparse L1=50%", codec="int8", attention="sparse", device_fraction=0.5, policy="h2o"))
    # precision that follows importance against the fixed int4 and int2 dense rows: the lightest
    # half of the blocks in int2, their int4 backups in L3 read back once a recall finds them heavy
    out.append(_kv("kvtier int2 dense L1=25%", codec="int2", attention="dense", device_fraction=0.25, policy="h2o"))
    out.append(_kv("kvtier importance int4/int2 dense L1=25%", codec="int4", attention="dense",
                   device_fraction=0.25, policy="h2o", precision="importance", heavy_fraction=0.0,
                   cold_fraction=0.5))
    out.append(_kv("kvtier int8 t2c dense L1=10%", codec="int8", order="tier-then-compress", attention="dense",
                   device_fraction=0.10, policy="lru"))
    return out


def check_configs(specs: list[CacheSpec], contexts: list[int], model_config=None, where: str = "") -> None:
    """Every configuration's parameters checked for every context (ValueError naming it)."""
    for spec in specs:
        try:
            spec.check(contexts, model_config)
        except ValueError as e:
            raise ValueError(f"{where}{e}") from None


def load_configs(path: str | Path) -> list[CacheSpec]:
    """Parse a TOML sweep file (see module docstring). Raises ValueError on bad entries."""
    if not Path(path).is_file():
        raise ValueError(f"--configs {path}: no such file")
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
        spec = CacheSpec(name, kind, e)
        specs.append(spec)
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


def _text_accuracy(ref: list[Result], got: list[Result], seed: int) -> dict:
    acc: dict = {}
    text = [(r, g) for r, g in zip(ref, got) if getattr(r.sample, "kind", None) == "text"]
    probe = [(r, g) for r, g in zip(ref, got) if getattr(r.sample, "kind", None) == "probe"]
    if text:
        ref_lp = torch.cat([r.logp for r, _ in text])
        lp = torch.cat([g.logp for _, g in text])
        targets = torch.cat([r.sample.continuation for r, _ in text])
        acc.update(metrics.compare(ref_lp, lp, targets))
        per = [metrics.compare(r.logp, g.logp, r.sample.continuation) for r, g in text]
        acc["ci"] = {k: metrics.mean_ci([p[k] for p in per], seed) for k in ("ppl_rel_change", "kl_mean",
                                                                               "top1_agreement")}
        acc["ci"]["ppl_rel_change"]["within_ci"] = bool(acc["ci"]["ppl_rel_change"]["lo"] <= 0.0
                                                        <= acc["ci"]["ppl_rel_change"]["hi"])
    if probe:
        pa = [metrics.top1_accuracy(g.logp, g.sample.continuation) for _, g in probe]
        pr = [metrics.top1_accuracy(r.logp, r.sample.continuation) for r, _ in probe]
        acc.update({"probe_acc": statistics.fmean(pa), "probe_acc_ref": statistics.fmean(pr),
                    "probe_rel": statistics.fmean(pa) / statistics.fmean(pr) if statistics.fmean(pr) > 0
                    else float("nan")})
        acc.setdefault("ci", {})["probe_acc"] = metrics.mean_ci(pa, seed)
        acc.setdefault("diff", {})["probe_acc"] = metrics.paired_diff(pr, pa, seed)
    return acc


def _ruler_accuracy(ref: list[Result], got: list[Result], seed: int) -> dict:
    pairs = [(_record(r, seed), _record(g, seed)) for r, g in zip(ref, got) if r.score is not None]
    return ruler_accuracy(pairs, seed) if pairs else {}


def _record(r: Result, seed: int) -> dict:
    """A RULER result as eval.json records a sample: named by task, index and the run's seed
    ((task, index) names a sample only within one seed's run, and runs are merged)."""
    rec = {"task": r.sample.task, "index": r.sample.index, "seed": seed, "score": r.score, "partial": r.partial,
           "prediction": r.prediction}
    if r.fidelity is not None:
        rec["fidelity"] = r.fidelity
    return rec


def ruler_accuracy(pairs: list[tuple[dict, dict]], seed: int) -> dict:
    """A row's RULER accuracy from (reference, row) sample records on the same samples (``_record``'s
    form, as eval.json keeps them): scores, the ratio to the reference and the paired difference with
    95% bootstrap intervals (``seed``), per task, the partial copies, and with fidelity on every sample
    its means and intervals. One computation for a run and for runs merged (``merge.py``)."""
    sc = [g["score"] for _, g in pairs]
    rs = [r["score"] for r, _ in pairs]
    tasks: dict = {}
    for _, g in pairs:
        tasks.setdefault(g["task"], []).append(g["score"])
    mean_ref = statistics.fmean(rs)
    part = [g["partial"] for _, g in pairs if g.get("partial") is not None]
    extra = {}
    if len(part) == len(pairs) and all(r.get("partial") is not None for r, _ in pairs):
        extra = {"partial": statistics.fmean(part),
                 "partial_ref": statistics.fmean(r["partial"] for r, _ in pairs)}
    out = {
        "ruler": statistics.fmean(sc), "ruler_ref": mean_ref,
        "ruler_rel": statistics.fmean(sc) / mean_ref if mean_ref > 0 else float("nan"),
        "ruler_tasks": {t: statistics.fmean(v) for t, v in sorted(tasks.items())},
        "ci": {"ruler": metrics.mean_ci(sc, seed), "ruler_rel": metrics.ratio_ci(rs, sc, seed)},
        "diff": {"ruler": metrics.paired_diff(rs, sc, seed)},
        "samples": [dict(g) for _, g in pairs],
        **extra,
    }
    if extra:
        out["ci"]["partial"] = metrics.mean_ci(part, seed)
    fid = [g.get("fidelity") for _, g in pairs]
    if all(f is not None for f in fid):
        # each sample counts once, whatever its answer's length: the intervals are over samples
        for key, name in (("kl", "fidelity_kl"), ("top1", "fidelity_top1")):
            vals = [f[key] for f in fid]
            out[name] = statistics.fmean(vals)
            out["ci"][name] = metrics.mean_ci(vals, seed)
        out["fidelity_steps"] = sum(f["steps"] for f in fid)
    return out


def summarise(spec: CacheSpec, context: int, ref: list[Result], got: list[Result], seed: int = 0) -> dict:
    """One row of the results: accuracy against ``ref`` on the same samples (with 95% bootstrap
    intervals and paired differences), footprint and cost."""
    acc = _text_accuracy(ref, got, seed)
    for k, v in _ruler_accuracy(ref, got, seed).items():
        if isinstance(v, dict) and k in acc:
            acc[k].update(v)
        else:
            acc[k] = v
    fp_keys = [k for k in got[0].footprint if isinstance(got[0].footprint[k], (int, float))]
    footprint = {k: statistics.fmean(g.footprint[k] for g in got) for k in fp_keys}
    steps = [s for g in got for s in g.step_s]
    cost = {
        "decode_tok_s": len(steps) / sum(steps) if steps else float("nan"),
        "tpot_p50_ms": 1e3 * _pct(steps, 0.50),
        "tpot_p99_ms": 1e3 * _pct(steps, 0.99),
        "prefill_s": statistics.fmean(g.prefill_s for g in got),
        "ttft_s": statistics.fmean(g.ttft_s for g in got),
        "shared_prefill": spec.reuses_prefill,
    }
    st = got[-1].stats
    if st:
        cost.update(_stats_cost(st, context + max(1, len(got[-1].step_s))))
        footprint["compression"] = st.get("compression", {})
        cost["recalled_from"] = _recalled_from(got)
    return {"config": spec.name, "kind": spec.kind, "anchor": spec.anchor, "params": dict(spec.params),
            "context": context, "accuracy": acc, "footprint": footprint, "cost": cost, "stats": st}


def _recalled_from(got: list[Result]) -> dict:
    """Where the blocks attended at decode came from, summed over the samples: L1 hits, and
    blocks brought back from L2 (DRAM) and L3 (SSD)."""
    out = {"l1": 0, "l2": 0, "l3": 0}
    for g in got:
        for t in out:
            out[t] += int(g.stats.get("hits", {}).get(t, 0))
    return out


def _stats_cost(st: dict, tokens: int) -> dict:
    swapped = sum(st.get("swap_in_bytes", {}).values()) + sum(st.get("swap_out_bytes", {}).values())
    pf = st.get("prefetch", {})
    return {
        "swap_bytes_per_token": swapped / tokens,
        "prefetch_precision": pf.get("precision"),
        "prefetch_coverage": pf.get("coverage"),
    }
