"""Prefill time of one model in bfloat16 against float32 on this CPU, as a ratio in one run.

kvtier picks the CPU compute dtype by machine (``kvtier.hardware.compute_dtype``): bfloat16 where
the CPU has native bf16 matrix instructions (AVX512_BF16, AMX-BF16, Arm BF16), float32 elsewhere,
where bf16 matmuls are emulated. This script is the measurement behind that rule: it loads the
model once per dtype and times the same prompt's prefill (no cache reuse) in each, alternating
dtypes between repetitions so a neighbour's load falls on both, and reports the median of each and
their ratio, next to the CPU's name, torch's ISA level and the rule's choice.

    python bench/bench_dtype.py                                    # SmolLM2, 1,024 tokens, 3 reps
    python bench/bench_dtype.py --model qwen2.5-coder-0.5b --tokens 2048
    python bench/bench_dtype.py --smoke                            # seconds; run by `make bench-smoke`
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _prefill_s(model, ids) -> float:
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
        return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="embedded model name or local path (default: SmolLM2-135M)")
    p.add_argument("--tokens", type=int, default=1024, help="prompt tokens per prefill")
    p.add_argument("--reps", type=int, default=3, help="timed prefills per dtype (after one warm-up each)")
    p.add_argument("--smoke", action="store_true", help="64 tokens, one rep: checks the script runs")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.reps = 64, 1

    from kvtier import hardware
    from kvtier.models import load_model, text_ids

    models = {}
    for dt in (torch.float32, torch.bfloat16):
        models[dt], tok = load_model(args.model, dtype=dt)
    ids = text_ids(tok, args.tokens)
    times: dict[torch.dtype, list[float]] = {dt: [] for dt in models}
    for dt, m in models.items():
        _prefill_s(m, ids)  # warm-up: first-call allocations and kernel selection
    for _ in range(args.reps):
        for dt, m in models.items():
            times[dt].append(_prefill_s(m, ids))
    fp32, bf16 = (statistics.median(times[dt]) for dt in (torch.float32, torch.bfloat16))
    out = {
        "cpu": hardware.cpu_name(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": hardware.cpu_has_native_bf16(), "rule_picks": str(hardware.compute_dtype("cpu")),
        "threads": torch.get_num_threads(), "model": args.model or "smollm2-135m", "tokens": ids.shape[1],
        "reps": args.reps, "float32_s": round(fp32, 3), "bfloat16_s": round(bf16, 3),
        "bf16_over_fp32": round(bf16 / fp32, 2),
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['cpu']} (torch: {out['torch_cpu_capability']}, native bf16: {out['native_bf16']}, "
              f"{out['threads']} threads); {out['model']}, {out['tokens']}-token prefill, median of {args.reps}:")
        print(f"  float32 {fp32:.3f} s, bfloat16 {bf16:.3f} s: bf16 takes {bf16 / fp32:.2f}x float32's time; "
              f"kvtier picks {out['rule_picks']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
