"""What naming a model costs: ``kvtier.identity.model_identity`` on the real model, beside a
plain read of the same bytes in the same run.

The identity reads every weight once (a wrapping sum of its bytes as 64-bit words, plus 64
sampled elements a tensor). Reported per dtype:

  identity    the first model_identity call (what attach pays once per model object)
  memo        a later call on the same model (a check of every tensor's version counter)
  read        one ``tensor.sum()`` over every tensor: the reference, what reading the bytes costs
  GB/s        bytes of the weights / identity seconds; ``x read``: identity / read seconds

and, from the measured GB/s, the estimated first-call time for the weights of an 8B and a 70B
model in bf16 on this CPU (one thread; a GPU reads them ~100x faster, and a sharded model is read
by every rank in parallel).

    python bench/bench_identity.py            # SmolLM2-135M in float32 and bfloat16, 5 repeats
    python bench/bench_identity.py --smoke    # one repeat, float32 only
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_ESTIMATE = {"8B": 8.0e9 * 2, "70B": 70.6e9 * 2}  # bf16 weight bytes


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(model, repeats: int) -> dict:
    from kvtier.identity import _named_tensors, model_identity

    tensors = [t for _, t in _named_tensors(model)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    firsts, reads = [], []
    for _ in range(repeats):  # alternated, so a busy core slows both sides alike
        m = copy.copy(model)  # a new object: no memo (its tensors are the same)
        firsts.append(_time(lambda: model_identity(m)))
        reads.append(_time(lambda: [t.sum() for t in tensors]))
    memo = _time(lambda: model_identity(m))
    ident = statistics.median(firsts)
    return {"bytes": nbytes, "identity_s": ident, "memo_s": memo, "read_s": statistics.median(reads),
            "gb_s": nbytes / ident / 1e9}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="one repeat, float32 only (seconds)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from kvtier.models import load_model

    dtypes = ["float32"] if args.smoke else list(_DTYPES)
    repeats = 1 if args.smoke else args.repeats
    print(f"cpu: {torch.backends.cpu.get_cpu_capability()}, 1 thread")
    print(f"{'dtype':9} {'MB':>6} {'identity s':>10} {'memo ms':>8} {'read s':>7} {'x read':>7} {'GB/s':>6}  "
          + "  ".join(f"est {k} bf16" for k in _ESTIMATE))
    for name in dtypes:
        model, _ = load_model(dtype=_DTYPES[name])
        r = measure(model, repeats)
        est = "  ".join(f"{b / r['gb_s'] / 1e9:11.1f}s" for b in _ESTIMATE.values())
        print(f"{name:9} {r['bytes'] / 1e6:6.0f} {r['identity_s']:10.3f} {1e3 * r['memo_s']:8.2f} "
              f"{r['read_s']:7.3f} {r['identity_s'] / r['read_s']:7.2f} {r['gb_s']:6.2f}  {est}")
        assert r["memo_s"] < r["identity_s"], "a memoized identity must not read the weights again"


if __name__ == "__main__":
    main()
