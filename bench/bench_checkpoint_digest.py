"""What the vLLM connector's engine identity costs: the digest of the checkpoint an engine loads
(``kvtier.vllm.identity.checkpoint_digest``), as a ratio to reading the same files'
bytes (``readinto`` into one buffer) and to a BLAKE2b of them, best of N, interleaved, in one run.
Both the scheduler and the worker process compute it once when the engine starts.

    python bench/bench_checkpoint_digest.py            # the embedded SmolLM2-135M (538 MB, float32)
    python bench/bench_checkpoint_digest.py --smoke    # a 32 MB synthetic checkpoint (CI)
    python bench/bench_checkpoint_digest.py --path DIR # any safetensors directory or .gguf file

The page cache is warm after the first pass (as it is when vLLM has just read the weights):
this measures the digest's own work; a cold read adds the disk's read time of the same bytes.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from pathlib import Path

import torch

from kvtier.vllm.identity import _safetensors_files, checkpoint_digest


def files_of(path: Path) -> list[Path]:
    return _safetensors_files(path) if path.is_dir() else [path]


def read_all(files: list[Path], buf: bytearray) -> None:
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def blake2b_all(files: list[Path], buf: bytearray) -> None:
    h = hashlib.blake2b()
    view = memoryview(buf)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                h.update(view[:n])


def best(fn, n: int) -> float:
    t = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return min(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a 32 MB synthetic checkpoint (seconds)")
    ap.add_argument("--path", help="a safetensors directory or .gguf file (default: the embedded model)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = None
    if args.smoke:
        from safetensors.torch import save_file

        tmp = tempfile.TemporaryDirectory()
        g = torch.Generator().manual_seed(0)
        save_file({f"layers.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(8)},
                  str(Path(tmp.name) / "model.safetensors"))
        path = Path(tmp.name)
    elif args.path:
        path = Path(args.path).expanduser()
    else:
        from kvtier.vllm import embedded_model_dir

        path = Path(embedded_model_dir())
    files = files_of(path)
    nbytes = sum(f.stat().st_size for f in files)
    buf = bytearray(4 << 20)
    checkpoint_digest(path)  # warms the page cache
    times = {"read": [], "blake2b": [], "digest": []}
    for _ in range(args.repeat):  # interleaved: a shared machine's noise hits all three alike
        times["read"].append(best(lambda: read_all(files, buf), 1))
        times["blake2b"].append(best(lambda: blake2b_all(files, buf), 1))
        times["digest"].append(best(lambda: checkpoint_digest(path), 1))
    t = {k: min(v) for k, v in times.items()}
    out = {"path": str(path), "bytes": nbytes, "seconds": {k: round(v, 4) for k, v in t.items()},
           "GB_per_s": {k: round(nbytes / v / 1e9, 2) for k, v in t.items()},
           "digest_time_vs_read": round(t["digest"] / t["read"], 2),
           "digest_time_vs_blake2b": round(t["digest"] / t["blake2b"], 2)}
    print(json.dumps(out, indent=1))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
