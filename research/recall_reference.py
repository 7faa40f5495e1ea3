"""Which recall reference fires on real attention: how many of the blocks ``precision="importance"``
stores in the cold codec would a later observation mark for upgrade, per ``recall_reference``
and ``recall_mass``.

One full-precision forward over context + continuation (eager attention, every layer's
probabilities) replays what the store observes in dense mode, without the store's moves::

    prefill chunks of --chunk queries   -> each block's statistic: mean over the chunks that
                                           saw it of mass / the chunk's mean mass per block
    cold blocks                          -> the lowest --cold-fraction by mid-rank among the
                                           sealed blocks, outside the sink and recent window
    continuation chunks (--decode-chunk) -> per observation and reference, the blocks whose
                                           mass reaches recall_mass x the reference: marked

The statistic and the cold set are the store's (``kvtier.store.precision``); the masses are the
unquantized model's, so this measures the criterion, not the codecs.

Decided (2026-12-01, commits c124c6b and f0a6be7): ``recall_reference="median"`` is the
default, the reference that fires where the all-block mean marks almost nothing (the counts
per text and layer: docs/results/codec-accuracy.md, "Recall upgrades").

    python research/recall_reference.py --texts pydoc,essays,squad --windows 2
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy_sweep import load_source, window_parser  # noqa: E402

REFERENCES = ("median", "mean", "all-mean")


def block_mass(probs: torch.Tensor, q0: int, q1: int, block: int) -> torch.Tensor:
    """Attention mass per key block of queries [q0, q1): probs [heads, T, T] -> [blocks of q1]."""
    per_token = probs[:, q0:q1, :q1].float().sum(dim=(0, 1))  # [q1]
    n = -(-q1 // block)
    out = torch.zeros(n * block)
    out[:q1] = per_token
    return out.view(n, block).sum(1)


def replay(probs: torch.Tensor, ctx: int, cont: int, block: int, chunk: int, decode_chunk: int,
           sink_blocks: int, window_blocks: int, cold_fraction: float, masses: tuple[float, ...]) -> dict:
    """One layer: counts of cold blocks and of those marked, per (reference, recall_mass)."""
    from kvtier.config import KVTierConfig
    from kvtier.store.precision import PrecisionPlan

    rel = torch.zeros(-(-(ctx + cont) // block))
    seen = torch.zeros_like(rel)
    for q0 in range(0, ctx, chunk):
        m = block_mass(probs, q0, min(q0 + chunk, ctx), block)
        rel[:len(m)] += m / m.mean()
        seen[:len(m)] += 1
    sealed = ctx // block
    protected = set(range(min(sink_blocks, sealed))) | set(range(max(0, sealed - window_blocks), sealed))
    plan = PrecisionPlan.of(KVTierConfig(precision="importance", heavy_fraction=0.0, cold_fraction=cold_fraction))
    stats = (rel[:sealed] / seen[:sealed]).tolist()
    ranking = sorted(stats)
    cold = [b for b in range(sealed) if b not in protected and plan.choose(ranking, stats[b]) == plan.cold]
    out = {"cold": len(cold)}
    marked = {(ref, rm): set() for ref in REFERENCES for rm in masses}
    for q0 in range(ctx, ctx + cont, decode_chunk):
        q1 = min(q0 + decode_chunk, ctx + cont)
        m = block_mass(probs, q0, q1, block).tolist()
        n = q1 // block  # sealed blocks at this step (the open one is the last of m when partial)
        prot = set(range(min(sink_blocks, n))) | set(range(max(0, n - window_blocks), n))
        candidates = [x for b, x in enumerate(m) if b < n and b not in prot]
        for ref in REFERENCES:
            for rm in masses:
                p = PrecisionPlan(plan.heavy, plan.base, plan.cold, 0.0, cold_fraction, rm, ref)
                th = p.recall_threshold(candidates, m)
                if th is not None:
                    marked[(ref, rm)].update(b for b in cold if m[b] >= th)
    for key, got in marked.items():
        out[key] = len(got)
    return out


@torch.inference_mode()
def main(argv=None) -> int:
    ap = window_parser(__doc__, windows=2, context=1024, block_tokens=64)
    ap.add_argument("--continuation", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--decode-chunk", type=int, default=32)
    ap.add_argument("--sink-blocks", type=int, default=1)
    ap.add_argument("--window-blocks", type=int, default=2)
    ap.add_argument("--cold-fraction", type=float, default=0.5)
    ap.add_argument("--recall-mass", default="1.5,2,3")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from kvtier.models import load_model

    masses = tuple(float(x) for x in args.recall_mass.split(","))
    model, tok = load_model(dtype=torch.float32, attn_implementation="eager")
    span = args.context + args.continuation
    print(f"cold blocks marked by a later observation (of the cold ones, all layers and windows); "
          f"context {args.context}, continuation {args.continuation} in {args.decode_chunk}-token observations")
    print("| text | cold blocks | " + " | ".join(f"{r} x{m:g}" for r in REFERENCES for m in masses) + " |")
    print("|---|---|" + "---|" * (len(REFERENCES) * len(masses)))
    for src in args.texts.split(","):
        ids = tok(load_source(src), add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        rng = random.Random(args.seed * 1_000_003 + args.context)  # accuracy_sweep's windows
        offsets = sorted(rng.randrange(0, ids.numel() - span) for _ in range(args.windows))
        total: dict = {}
        for o in offsets:
            out = model(input_ids=ids[o:o + span].view(1, -1), output_attentions=True)
            for probs in out.attentions:  # [1, heads, T, T] per layer
                got = replay(probs[0], args.context, args.continuation, args.block_tokens, args.chunk,
                             args.decode_chunk, args.sink_blocks, args.window_blocks, args.cold_fraction, masses)
                for k, v in got.items():
                    total[k] = total.get(k, 0) + v
            del out
        cold = total["cold"]
        cells = [f"{total[(r, m)]} ({100 * total[(r, m)] / max(cold, 1):.0f}%)" for r in REFERENCES for m in masses]
        print(f"| {src} | {cold} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
