"""Sparse-attention settings measured on the harness's recall probe, over several texts.

What a sparse default must get right is recall: a passage far back in the context, evicted to
L2/L3, has to be selected again when the query asks for it. ``kvtier eval``'s recall probe
(:func:`kvtier.eval.data.probe_windows`) plants a random-word passage at a random depth and cues
its first third at the end; the score is the top-1 accuracy on the rest. This script runs only
those windows (text windows measure something else), on several texts and contexts, for a grid
of sparse settings at one L1 = budget fraction, every setting from the same shared prefill::

    text x context x window  --prefill once-->  reference (DynamicCache), each setting
    per setting: accuracy over all windows, ratio to the reference's accuracy on the same
                 windows, and its 95% bootstrap interval (windows resampled in pairs, seeded)

The settings are kvtier rows of :mod:`kvtier.eval.sweep` (``CacheSpec`` params: KVTierConfig
fields plus ``device_fraction`` / ``host_fraction``); "default" is ``KVTierConfig``'s defaults with
only ``attention="sparse"`` and L1 set, so the table says what a user who changes nothing else
gets. L2 holds 2% of the context's 16-bit KV, so most evicted blocks live on L3.

Decided (2026-11-30 .. 12-01): the sparse defaults, 16-token blocks, 2-token key centroids
(``digest_tokens``, commit 7dcb4d0; 2-token and per-key digests in the grid: 0cba3bf), kept as
int8 with a float32 scale (``digest_dtype``, d6e0df2), one sink block, the recent window, h2o;
the figures (ratio to the reference with 95% intervals) are in docs/transformers.md and
docs/results/config-defaults.md (``select_score``, ``digest_tokens``, ``digest_dtype``).

    python research/sparse_sweep.py --grid split --contexts 2048,4096 --windows 6
    python research/sparse_sweep.py --grid defaults --l1 0.125,0.06,0.03
    python research/sparse_sweep.py --smoke
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _row(name: str, **params) -> tuple[str, dict]:
    params.setdefault("attention", "sparse")
    return name, params


def grids() -> dict[str, list[tuple[str, dict]]]:
    """Named grids of settings (name, CacheSpec params without the L1 fraction)."""
    return {
        # block size x digest resolution, at the selection and policy of the defaults, digests in
        # the KV dtype (bf16 here)
        "digest": [
            _row("b64 d64", block_tokens=64, digest_tokens=64, digest_dtype="kv"),
            _row("b32 d32", block_tokens=32, digest_tokens=32, digest_dtype="kv"),
            _row("b32 d8", block_tokens=32, digest_tokens=8, digest_dtype="kv"),
            _row("b32 d4", block_tokens=32, digest_tokens=4, digest_dtype="kv"),
            _row("b16 d16", block_tokens=16, digest_tokens=16, digest_dtype="kv"),
            _row("b16 d8", block_tokens=16, digest_tokens=8, digest_dtype="kv"),
            _row("b16 d4", block_tokens=16, digest_tokens=4, digest_dtype="kv"),
            _row("b16 d2", block_tokens=16, digest_tokens=2, digest_dtype="kv"),
            _row("b16 d1", block_tokens=16, digest_tokens=1, digest_dtype="kv"),
            _row("b16 quest", block_tokens=16, select_score="quest", digest_dtype="kv"),
        ],
        # int8 digests (a float32 scale per centroid) against the same resolutions in bf16:
        # an int8 centroid costs head_dim + 4 bytes, a bf16 one 2 * head_dim
        "digest8": [
            _row("b16 d4 bf16dig", block_tokens=16, digest_tokens=4, digest_dtype="kv"),
            _row("b16 d2 bf16dig", block_tokens=16, digest_tokens=2, digest_dtype="kv"),
            _row("b16 d4 i8dig", block_tokens=16, digest_tokens=4, digest_dtype="int8"),
            _row("b16 d2 i8dig", block_tokens=16, digest_tokens=2, digest_dtype="int8"),
            _row("b16 d1 i8dig", block_tokens=16, digest_tokens=1, digest_dtype="int8"),
        ],
        # how the budget is split: sinks and window (the rest is top-k), and the policy
        "split": [
            _row("b16 d4 s1w2 h2o", block_tokens=16, digest_tokens=4),
            _row("b16 d4 s1w1", block_tokens=16, digest_tokens=4, window_tokens=16),
            _row("b16 d4 s1w0", block_tokens=16, digest_tokens=4, window_tokens=0),
            _row("b16 d4 s0w1", block_tokens=16, digest_tokens=4, sink_tokens=0, window_tokens=16),
            _row("b16 d4 s1w4", block_tokens=16, digest_tokens=4, window_tokens=64),
            _row("b16 d4 lru", block_tokens=16, digest_tokens=4, policy="lru"),
            _row("b16 d4 snapkv", block_tokens=16, digest_tokens=4, policy="snapkv"),
            _row("b16 d4 sink-window", block_tokens=16, digest_tokens=4, policy="sink-window"),
        ],
        # what the probe loses to: the codec of recalled blocks, the policy, the fixed parts
        "diag": [
            _row("b16 d4 bf16", block_tokens=16, digest_tokens=4, codec="bf16"),
            _row("b16 d4 int8", block_tokens=16, digest_tokens=4, codec="int8"),
            _row("b16 d4 h2o", block_tokens=16, digest_tokens=4, policy="h2o"),
            _row("b16 d4 w0", block_tokens=16, digest_tokens=4, window_tokens=0),
            _row("b16 d4 s0", block_tokens=16, digest_tokens=4, sink_tokens=0),
        ],
        # the configuration defaults against the settings the issue compared
        "defaults": [
            _row("default"),
        ],
    }


def load_source(name: str) -> str:
    from accuracy_sweep import load_source as load

    return load(name)


def ratio_ci(ref: list[float], got: list[float], seed: int, resamples: int = 2000) -> tuple[float, float, float]:
    """mean(got) / mean(ref) and its 95% percentile bootstrap interval, windows resampled in pairs."""
    import numpy as np

    r, g = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, r.size, size=(resamples, r.size))
    rs, gs = r[idx].mean(axis=1), g[idx].mean(axis=1)
    ok = rs > 0
    ratios = gs[ok] / rs[ok]
    point = g.mean() / r.mean() if r.mean() > 0 else float("nan")
    if ratios.size == 0:
        return point, float("nan"), float("nan")
    return float(point), float(np.quantile(ratios, 0.025)), float(np.quantile(ratios, 0.975))


def report(records: list[dict], seed: int = 0) -> str:
    """Markdown table: per setting, the ratio of its probe accuracy to the reference's on the
    same windows, per context, over all, and per text, with 95% bootstrap intervals."""
    from kvtier.eval.sweep import REFERENCE

    def key(r):
        return (r["text"], r["context"], r["window"], r["seed"])

    ref = {key(r): r["acc"] for r in records if r["setting"] == REFERENCE.name}
    settings = list(dict.fromkeys(r["setting"] for r in records if r["setting"] != REFERENCE.name))
    texts = list(dict.fromkeys(r["text"] for r in records))
    contexts = sorted({r["context"] for r in records})
    header = ["setting"] + [str(c) for c in contexts] + ["all"] + texts + ["windows", "L1 B/token"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def cell(pairs, ci=True):
        if not pairs:
            return "-"
        p, lo, hi = ratio_ci([a for a, _ in pairs], [b for _, b in pairs], seed)
        return f"{p:.2f} [{lo:.2f}, {hi:.2f}]" if ci else f"{p:.2f}"

    refrow = [f"{REFERENCE.name} (accuracy)"]
    for group in ([lambda k, c=c: k[1] == c for c in contexts] + [lambda k: True]
                  + [lambda k, t=t: k[0] == t for t in texts]):
        vals = [a for k, a in ref.items() if group(k)]
        refrow.append(f"{statistics.fmean(vals):.2f}" if vals else "-")
    kv16 = [r["l1_bytes_per_token"] for r in records if r["setting"] == REFERENCE.name and r.get("l1_bytes_per_token")]
    lines.append("| " + " | ".join(refrow + [str(len(ref)), f"{statistics.fmean(kv16):.0f}" if kv16 else "-"]) + " |")
    for s in settings:
        got = {key(r): r["acc"] for r in records if r["setting"] == s and key(r) in ref}
        row = [s]
        row += [cell([(ref[k], a) for k, a in got.items() if k[1] == c]) for c in contexts]
        row.append("**" + cell([(ref[k], a) for k, a in got.items()]) + "**")
        row += [cell([(ref[k], a) for k, a in got.items() if k[0] == t], ci=False) for t in texts]
        row.append(str(len(got)))
        l1 = [r["l1_bytes_per_token"] for r in records if r["setting"] == s and r.get("l1_bytes_per_token")]
        row.append(f"{statistics.fmean(l1):.0f}" if l1 else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", default="digest", help=f"one of {sorted(grids())}, or a comma list of them")
    ap.add_argument("--only", default=None, help="comma-separated substrings: keep settings whose name has one")
    ap.add_argument("--texts", default="pydoc,essays,squad")
    ap.add_argument("--contexts", default="2048,4096")
    ap.add_argument("--windows", type=int, default=4, help="probe windows per text and context")
    ap.add_argument("--l1", default="0.125", help="comma-separated L1 = budget fractions of the context")
    ap.add_argument("--host-fraction", type=float, default=0.02)
    ap.add_argument("--policy", default=None,
                    help="eviction policy of every setting that names none (lru: every setting starts from the "
                         "shared prefill, several times faster; the policy only decides which blocks stay in L1 "
                         "at full precision, selection reaches every tier)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None, help="append one JSON line per setting and window to this file")
    ap.add_argument("--report", default=None, help="only print the table of these comma-separated --out files")
    ap.add_argument("--smoke", action="store_true", help="one text, one short window, two settings")
    args = ap.parse_args(argv)
    if args.report:
        records = [json.loads(line) for f in args.report.split(",") for line in Path(f).read_text().splitlines()]
        print(report(records, args.seed))
        return 0

    from kvtier.eval.caches import CacheSpec
    from kvtier.eval.data import probe_windows, tokenize
    from kvtier.eval.metrics import top1_accuracy
    from kvtier.eval.runner import run_all
    from kvtier.eval.sweep import REFERENCE
    from kvtier.models import load_model

    torch.set_num_threads(args.threads)
    all_grids = grids()
    if args.smoke:
        args.texts, args.contexts, args.windows, args.l1 = "pydoc", "512", 1, "0.25"
        rows = all_grids["defaults"] + all_grids["digest"][1:2]
    else:
        rows = []
        for g in args.grid.split(","):
            if g not in all_grids:
                raise SystemExit(f"--grid {g!r}: one of {sorted(all_grids)}")
            rows += [r for r in all_grids[g] if r[0] not in {n for n, _ in rows}]
    if args.only:
        keep = [s.strip() for s in args.only.split(",") if s.strip()]
        rows = [r for r in rows if any(k in r[0] for k in keep)]
    fractions = [float(x) for x in args.l1.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    if args.policy:
        rows = [(n, {"policy": args.policy, **p}) for n, p in rows]
    specs = [CacheSpec(f"{name} L1={f:.1%}", "kvtier",
                       dict(params, device_fraction=f, host_fraction=args.host_fraction, write_through=False,
                            disk_bytes=1 << 30))
             for f in fractions for name, params in rows]
    for s in specs:
        s.check(contexts)

    model, tok = load_model(args.model, dtype=torch.bfloat16)
    model.eval()
    records = []
    out = open(args.out, "a") if args.out else None
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="kvtier-sparse-sweep-") as tmp:
            for text_name in args.texts.split(","):
                text = load_source(text_name)
                ids = tokenize(tok, text)
                for ctx in contexts:
                    for i, w in enumerate(probe_windows(tok, text, ids, ctx, args.windows, seed=args.seed)):
                        for r in run_all(model, [REFERENCE] + specs, w, Path(tmp)):
                            if not hasattr(r, "spec"):
                                raise SystemExit(f"a setting could not run: {r}")
                            rec = {"setting": r.spec.name, "params": r.spec.params, "text": text_name,
                                   "context": ctx, "window": i, "seed": args.seed, "depth": w.depth,
                                   "acc": top1_accuracy(r.logp, w.continuation),
                                   "l1_bytes_per_token": r.footprint.get("l1_bytes_per_token")}
                            records.append(rec)
                            if out:
                                out.write(json.dumps(rec) + "\n")
                                out.flush()
                        print(f"  {text_name} {ctx} window {i}: {time.perf_counter() - t0:.0f} s", file=sys.stderr,
                              flush=True)
    finally:
        if out:
            out.close()
    print(f"recall probe: texts {args.texts}, contexts {contexts}, {args.windows} windows each, seed {args.seed}, "
          f"{time.perf_counter() - t0:.0f} s")
    print(report(records, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
