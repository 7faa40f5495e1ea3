"""Speculative decoding on a TieredCache: generate()'s prompt-lookup and assisted (draft model)
decoding against plain greedy decode, on the real model.

Each of them needs a cache that can be cropped: the verification forward appends every drafted
token, and the ones the model rejects are cut off again (``TieredCache.crop``, across blocks
already evicted). The draft is SmolLM2 drafting for itself: its first ``--draft-layers`` layers
(self-speculative decoding, as in LayerSkip), on a DynamicCache of its own.

The prompt is real text (pydoc topics) followed by its own first half again, the shape of an
edit or summary that quotes its input, where drafts from the prompt pay. All runs share one
process; for each cache, ratios are to plain decode on that cache:

  dynamic         transformers DynamicCache (the reference)
  kvtier-dense    TieredCache, lossless codec (the model's dtype), L1 = 25% of the context
  kvtier-int4     TieredCache, int4 below L1 (lossy: drafts and verification see the same KV)

Reported per (cache, method): new tokens/s, ratio to plain decode on the same cache, tokens
cropped, and whether the tokens equal plain greedy decode on the same cache (greedy speculative
decoding reproduces it up to the numerics of the multi-token verification step).

    python bench/bench_speculative.py              # 1k context, 64 new tokens
    python bench/bench_speculative.py --smoke      # seconds; run by `make bench-smoke`
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.baselines

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _draft(model, layers: int):
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    return draft


def _cache(kind: str, model, ctx: int, tmp: str):
    import kvtier
    from tests.baselines import make_baseline

    if kind == "dynamic":
        return make_baseline("dynamic", model)
    lossless = "bf16" if next(model.parameters()).dtype == torch.bfloat16 else "fp16"
    bt = 16 if ctx < 512 else 64
    cfg = kvtier.KVTierConfig(block_tokens=bt, device_tokens=max(2 * bt, ctx // 4 // bt * bt),
                              host_bytes=64 << 20, disk_path=f"{tmp}/{kind}", policy="lru",
                              codec=lossless if kind == "kvtier-dense" else "int4")
    return kvtier.attach(model, cfg)


def _run(model, ids, cache, new: int, gen: dict):
    from tests.baselines import greedy_generate

    t0 = time.perf_counter()
    out = greedy_generate(model, ids, cache, new, **gen)
    dt = time.perf_counter() - t0
    cropped = cache.stats()["integration"]["cropped_tokens"] if hasattr(cache, "stats") else None
    return out, dt, cropped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=1024, help="prompt tokens (half of them quoted again)")
    p.add_argument("--new", type=int, default=64, help="new tokens per run")
    p.add_argument("--draft-layers", type=int, default=10)
    p.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens")
    p.add_argument("--dtype", choices=["auto", *sorted(_DTYPES)], default="auto",
                    help="model dtype; auto: kvtier.hardware.compute_dtype (bf16 only on a CPU with native bf16)")
    p.add_argument("--caches", default="dynamic,kvtier-dense,kvtier-int4")
    p.add_argument("--smoke", action="store_true", help="128-token prompt, 6 new tokens, two caches")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.dtype == "auto":
        from kvtier.hardware import compute_dtype

        args.dtype = str(compute_dtype("cpu")).removeprefix("torch.")
    if args.smoke:
        args.context, args.new, args.caches = 128, 6, "dynamic,kvtier-dense"

    from kvtier.models import load_model, load_tokenizer, text_ids

    torch.manual_seed(0)
    model = load_model(dtype=_DTYPES[args.dtype], device="cpu")[0]
    tok = load_tokenizer()
    half = args.context // 2
    base = text_ids(tok, args.context - half, offset=5000)
    ids = torch.cat([base, base[:, :half]], dim=1)
    draft = _draft(model, args.draft_layers)
    methods = {"plain": {}, "prompt-lookup": dict(prompt_lookup_num_tokens=args.lookup_tokens),
               "assisted": dict(assistant_model=draft)}
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-spec-") as tmp:
        # warm-up (kernels, the compiled CPU codec) outside the timed runs
        _run(model, ids[:, :64], _cache("dynamic", model, 64, tmp), 2, {})
        for kind in args.caches.split(","):
            plain = None
            for name, gen in methods.items():
                cache = _cache(kind, model, ids.shape[1], tmp)
                try:
                    out, dt, cropped = _run(model, ids, cache, args.new, gen)
                finally:
                    if hasattr(cache, "close"):
                        cache.close()
                if plain is None:
                    plain = (out, dt)
                rows.append(dict(cache=kind, method=name, tokens_per_s=args.new / dt,
                                 speedup_vs_plain=plain[1] / dt, cropped_tokens=cropped,
                                 same_as_plain=bool(torch.equal(out, plain[0]))))
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"context {ids.shape[1]} tokens, {args.new} new, {args.dtype}, draft = first "
              f"{args.draft_layers} of {model.config.num_hidden_layers} layers")
        print(f"{'cache':14} {'method':14} {'tok/s':>8} {'vs plain':>9} {'cropped':>8} same")
        for r in rows:
            print(f"{r['cache']:14} {r['method']:14} {r['tokens_per_s']:8.2f} {r['speedup_vs_plain']:8.2f}x "
                  f"{'-' if r['cropped_tokens'] is None else r['cropped_tokens']:>8} {r['same_as_plain']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
