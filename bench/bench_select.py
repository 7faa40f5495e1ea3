"""The sparse decode step's selection and estimate of the rest, per layer call, by scorer path.

Every sparse step with ``rest_attention="estimate"`` (the default) scores the candidate blocks'
key digests twice over: once to pick the top blocks, once to estimate the attention of those it
left out. This script times that call (``Selector.select_with_rest``) on a store filled with
random K/V at a model's layer shape and L1 = 3% of the context, three ways, alternated per round:

- ``compiled``: the C scorer reading the digest table in place, selection and estimate in one
  call (the CPU path where a C compiler is found);
- ``torch``: the torch math (no C compiler; on CUDA the same math, with the Triton kernel for the
  logits), the estimate taking the blocks left out from the selection's logits;
- ``torch, digest twice``: ``select`` and then ``rest_estimate`` on their own, the digest read
  again for the estimate: the in-run reference the other two are divided by.

All three are checked to choose the same blocks and agree on the estimate.

    python bench/bench_select.py                                   # Qwen2.5-0.5B's layer, 8k and 32k
    python bench/bench_select.py --shape llama-3-8b --contexts 32768
    python bench/bench_select.py --smoke                           # seconds; run by `make bench-smoke`
"""
from __future__ import annotations

import argparse
import json
import time

import torch

# (kv heads, query heads, head_dim) of one layer
SHAPES = {"qwen2.5-0.5b": (2, 14, 64), "llama-3-8b": (8, 32, 128), "smollm2-135m": (3, 9, 64)}


def _store(kvh: int, hd: int, ctx: int, digest_dtype: str):
    from kvtier.config import KVTierConfig
    from kvtier.store import KVStore

    bt = 16
    budget = max(ctx * 3 // 100 // bt, 8) * bt
    cfg = KVTierConfig(block_tokens=bt, device_tokens=budget + 4 * bt, host_bytes=ctx * kvh * hd * 2,
                       codec="int4", attention="sparse", policy="lru", prefetch=False,
                       digest_dtype=digest_dtype)
    st = KVStore(cfg, num_layers=1, kv_heads=kvh, head_dim=hd, dtype=torch.float32)
    s = st.add_sequence()
    g = torch.Generator().manual_seed(ctx + hd)
    for lo in range(0, ctx, 4096):
        n = min(4096, ctx - lo)
        # a shared offset per channel, as real keys have: digests that do not all score alike
        k = torch.randn(kvh, n, hd, generator=g) + torch.linspace(-2, 2, hd)
        st.append(s, 0, k, torch.randn(kvh, n, hd, generator=g))
    return st, st.residency.tables[s][0], budget


def measure(shape: str, ctx: int, digest_dtype: str, rounds: int, calls: int) -> dict:
    kvh, qh, hd = SHAPES[shape]
    st, t, budget = _store(kvh, hd, ctx, digest_dtype)
    sel = st.selector
    q = torch.randn(qh, 1, hd, generator=torch.Generator().manual_seed(1))
    scale = hd ** -0.5

    def once():
        return sel.select_with_rest(t, q, budget, scale)

    def twice():
        blocks = sel.select(t, q, budget)
        return blocks, sel.rest_estimate(t, q, blocks, scale)

    ways = [("torch", False, once), ("torch, digest twice", False, twice)]
    if sel.compiled:  # the C scorer was built and loaded on this machine
        ways.insert(0, ("compiled", True, once))
    out, ref = {}, None
    for name, compiled, fn in ways:  # agreement, and a warm-up of each
        sel.compiled = compiled
        blocks, (o, lse) = fn()
        if ref is None:
            ref = (blocks, o, lse)
        elif blocks != ref[0] or not (torch.allclose(o, ref[1], atol=1e-4, rtol=1e-4)
                                      and torch.allclose(lse, ref[2], atol=1e-4, rtol=1e-4)):
            raise AssertionError(f"{name} disagrees with {ways[0][0]} at {ctx} tokens ({digest_dtype} digest)")
        out[name] = []
    for r in range(rounds):
        for name, compiled, fn in ways[r % len(ways):] + ways[: r % len(ways)]:  # order rotated
            sel.compiled = compiled
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            out[name].append((time.perf_counter() - t0) / calls * 1e3)
    st.close()
    base = min(out["torch, digest twice"])
    return {"shape": shape, "context": ctx, "digest_dtype": digest_dtype, "blocks": t.n_sealed,
            "budget_tokens": budget,
            "ms": {n: round(min(v), 3) for n, v in out.items()},
            "x_reference": {n: round(base / min(v), 2) for n, v in out.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES), help="one layer's shape")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768], help="tokens in the store")
    p.add_argument("--digests", nargs="+", default=["int4", "int8"], choices=["int4", "int8", "kv"],
                   help="digest_dtype values to time")
    p.add_argument("--rounds", type=int, default=5, help="rounds (the best of them is reported)")
    p.add_argument("--calls", type=int, default=20, help="timed calls a way per round")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--smoke", action="store_true", help="1k tokens, one round: checks the script runs")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    if args.smoke:
        args.contexts, args.rounds, args.calls = [1024], 1, 2
    torch.set_num_threads(args.threads)
    rows = [measure(args.shape, c, d, args.rounds, args.calls) for c in args.contexts for d in args.digests]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"select + estimate per layer call, {args.shape}, L1 = 3%, {args.threads} thread(s), best of "
          f"{args.rounds} rounds x {args.calls} calls; x = against the torch path reading the digest twice")
    print("| context | digest | " + " | ".join(rows[0]["ms"]) + " |")
    print("|---|---|" + "---|" * len(rows[0]["ms"]))
    for r in rows:
        cells = [f"{ms:.2f} ms ({r['x_reference'][n]:.2f}x)" for n, ms in r["ms"].items()]
        print(f"| {r['context']} | {r['digest_dtype']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
