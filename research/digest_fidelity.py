"""How much of a key digest's selection survives storing it in int8 (``digest_dtype``).

On the model's real keys and queries (post-RoPE, captured during one prefill of each window),
for the last ``--queries`` positions of each window and every layer: the candidate blocks
(sealed, between the sink and the recent window, as ``Selector.select`` sees them), each
digest's top-k by the store's centroid score (softmax over every sub-block centroid per query
head, best head, a block as its best part; k = the blocks a budget of ``--budget`` of the
context leaves for query selection), and

    mass/oracle   the true attention mass (all heads, over the candidates) the selection covers,
                  as a share of what the k heaviest blocks hold
    same blocks   the share of one digest's selection the other one selects too

for bf16 and int8 centroids at 4, 2 and 1 tokens. Cheap next to ``sparse_sweep.py`` (one
forward pass per window, no decode), and free of the probe's noise: it isolates the digest.

Decided (2026-12-01, commit e74a01d): key centroids are stored as int8 (``digest_dtype``):
they select 98% the same blocks as bf16 ones, covering the same share of the oracle's mass
(0.840 against 0.841; docs/transformers.md).

    python research/digest_fidelity.py --texts pydoc,essays,squad --windows 1
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    from accuracy_sweep import window_parser

    ap = window_parser(__doc__, windows=1, context=2048, block_tokens=16)
    ap.add_argument("--budget", type=float, default=0.125)
    ap.add_argument("--queries", type=int, default=32, help="query positions per window (the last ones)")
    args = ap.parse_args(argv)

    import transformers.models.llama.modeling_llama as llama

    from accuracy_sweep import load_source
    from kvtier.eval.data import tokenize
    from kvtier.models import load_model
    from kvtier.store.table import dequantize_rows, quantize_rows

    torch.set_num_threads(1)
    model, tok = load_model(None, dtype=torch.bfloat16)
    model.eval()
    captured = []
    rope = llama.apply_rotary_pos_emb

    def capture(q, k, *a, **kw):
        q, k = rope(q, k, *a, **kw)
        captured.append((q.detach(), k.detach()))
        return q, k

    llama.apply_rotary_pos_emb = capture
    bt, ctx = args.block_tokens, args.context
    sink, window = 1, 2  # the config's defaults at 16-token blocks and this budget
    k_sel = int(ctx * args.budget) // bt - 1 - sink - window
    digests = [(f"{name} d{dt}", dd, dt) for dt in (4, 2, 1) for name, dd in (("bf16", "kv"), ("int8", "int8"))]
    mass_share = {n: 0.0 for n, _, _ in digests}
    same = {dt: 0.0 for dt in (4, 2, 1)}
    n = 0
    for text in args.texts.split(","):
        ids = tokenize(tok, load_source(text))
        for w in range(args.windows):
            start = (w * 102_947) % (ids.numel() - ctx - 1)  # spread, reproducible offsets
            captured.clear()
            with torch.no_grad():
                model(ids[start:start + ctx].view(1, -1))
            for q, k in captured:  # q [1, q_heads, T, hd], k [1, kv_heads, T, hd]
                q, k = q[0].float(), k[0]
                qh, T, hd = q.shape
                kvh = k.shape[0]
                for t in range(T - args.queries, T):
                    ns = t // bt
                    lo, hi = sink, ns - window
                    m = hi - lo
                    if m <= k_sel:
                        continue
                    qt = q[:, t].view(kvh, qh // kvh, hd)
                    keys = k[:, : ns * bt]
                    att = torch.softmax(torch.einsum("hgd,htd->hgt", qt, keys.float()) / math.sqrt(hd), -1)
                    mass = att.sum(dim=(0, 1)).view(ns, bt).sum(1)[lo:hi]
                    oracle = mass.topk(k_sel).values.sum()
                    picks = {}
                    for name, dd, dt in digests:
                        p = bt // dt
                        cent = keys[:, lo * bt: hi * bt].reshape(kvh, m, p, dt, hd).mean(3, dtype=torch.float32)
                        cent = cent.bfloat16().float() if dd == "kv" else dequantize_rows(*quantize_rows(cent))
                        s = torch.einsum("hgd,hjd->hgj", qt, cent.reshape(kvh, m * p, hd)) / math.sqrt(hd)
                        sel = torch.softmax(s, -1).amax(dim=(0, 1)).view(m, p).amax(1).topk(k_sel).indices
                        picks[name] = set(sel.tolist())
                        mass_share[name] += float(mass[sel].sum() / oracle)
                    for dt in same:
                        same[dt] += len(picks[f"bf16 d{dt}"] & picks[f"int8 d{dt}"]) / k_sel
                    n += 1
            print(f"  {text} window {w} done", file=sys.stderr, flush=True)
    print(f"digest fidelity: texts {args.texts}, {args.windows} windows of {ctx} tokens, {args.queries} queries "
          f"x {len(captured)} layers each ({n} selections of {k_sel} blocks)")
    print("| digest | mass/oracle | same blocks as bf16 |\n|---|---|---|")
    for name, dd, dt in digests:
        print(f"| {name} | {mass_share[name] / n:.4f} | {'-' if dd == 'kv' else f'{same[dt] / n:.4f}'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
