"""Time to first token with a shared prefix, on the real model.

A 4k-token prompt whose first 3k tokens are a prefix another request already computed (a system
prompt, a document). Time to first token = the prefill forward that yields the first token's
logits (plus, when warm, ``TieredCache.load_prefix``):

  cold        full prefill, plain TieredCache (no L3/L4): the reference every ratio is to
  populate    request 1 (prefix, then its own suffix) with L3 + L4 write-through: what the first
              request pays; it leaves the prefix in the store, the L3 directory and redis
  warm-l2     later requests in the same process and store (prefix blocks in L2, some in L1)
  warm-l2-masked  (--masked) warm-l2 with the split prefill switched off: one SDPA over the
              explicit [new, prefix + new] mask, the path before kvtier attended warm prefills
              itself (kvtier.hf.attention.split_prefix_attention)
  warm-l3     later requests in a NEW process on the same L3 directory (a restart)
  warm-redis  later requests in a NEW process with no disk, the prefix coming from a
              redis-server started here (skipped when redis-server is not installed)

Every warm case runs ``--repeat`` times, each time a new request (same prefix, own suffix) and a
new cache (in the new processes a new store too: nothing in L1/L2), and each warm run is paired
with a cold prefill of the same prompt measured right after it in the same process. ``x cold``
is the median of those pairs' ratios, so a busy machine (other jobs on the cores) moves both
sides of a pair alike; ``cpu x`` is the same median over the CPU time this process spent, which
contention for the cores does not inflate (but which leaves out the redis server's work). The
warm time is split into ``load`` (``load_prefix``: finding and attaching the prefix blocks, from
L2, L3 files or redis) and ``fwd`` (the model computing the new tokens over them). Codec
``bf16`` (lossless for the bf16 model); ``same_token`` says whether every warm run's first token
equals its cold one's. Target: warm-l3 <= 0.4x cold.

    python bench/bench_prefix.py            # 4096-token prompt, 3072 shared, 3 repeats
    python bench/bench_prefix.py --masked   # also the masked-SDPA warm prefill, for comparison
    python bench/bench_prefix.py --smoke    # seconds; run by `make bench-smoke`
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.redis_server import REDIS_SERVER, start_redis_server  # noqa: E402  (the tests' loopback server)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_CODEC = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp16"}


def make_config(args, **kw):
    from kvtier.config import KVTierConfig

    base = dict(block_tokens=args.block_tokens, device_tokens=args.device_tokens, codec=_CODEC[args.dtype],
                host_bytes=args.host_mb << 20, policy="lru", attention="dense", dtype=args.dtype)
    base.update(kw)
    return KVTierConfig(**base)


def request(tok, args, k: int):
    """Request ``k``: the shared prefix, then a suffix of its own (so no request finds another's
    suffix blocks). [1, prompt]."""
    from kvtier.models import text_ids

    suffix = args.prompt - args.prefix
    prefix = text_ids(tok, args.prefix, offset=0)
    return torch.cat((prefix, text_ids(tok, suffix, offset=args.prefix + (k + 1) * suffix)), 1)


@torch.no_grad()
def timed_prefill(model, cache, ids, load: bool) -> dict:
    """Time to the first token's logits: ``s`` in all, of which ``load_s`` in ``load_prefix``;
    ``cpu_s`` the CPU time of this process meanwhile (all its threads; not the redis server's);
    ``loaded`` tokens found, ``tok`` the first token id."""
    c0, t0 = time.process_time(), time.perf_counter()
    n = cache.load_prefix(ids) if load else 0
    t1 = time.perf_counter()
    logits = model(input_ids=ids[:, n:], cache=cache, logits_to_keep=1).logits  # [1, 1, vocab]
    tok = int(logits[0, -1].argmax())
    t2, c2 = time.perf_counter(), time.process_time()
    return {"s": t2 - t0, "load_s": t1 - t0, "forward_s": t2 - t1, "cpu_s": c2 - c0, "loaded": n, "tok": tok}


def cold(model, args, ids) -> dict:
    from kvtier.hf.cache import TieredCache

    cache = TieredCache(make_config(args), model)
    try:
        return timed_prefill(model, cache, ids, load=False)
    finally:
        cache.close()


@contextlib.contextmanager
def masked_prefill():
    """Switch the split prefill off (kvtier attention then runs SDPA over the explicit mask):
    the reference for what splitting buys. A measuring device of this script only."""
    from kvtier.hf import attention

    real = attention._splittable
    attention._splittable = lambda *a, **k: False
    try:
        yield
    finally:
        attention._splittable = real


def warm_runs(model, tok, args, ks, make_cache, before_after=None) -> dict:
    """One warm prefill per request ``k`` in ``ks``, each on a cache from ``make_cache()`` and
    paired with a cold prefill of the same prompt right after it. Returns the pairs' summary."""
    pairs, hit = [], {}
    for k in ks:
        ids = request(tok, args, k)
        cache = make_cache()
        before = before_after(cache) if before_after else cache.stats()
        w = timed_prefill(model, cache, ids, load=True)
        hit = hits(before, before_after(cache) if before_after else cache.stats())
        cache.reset()  # the conversation ends; its prefix blocks stay where they are
        cache.close()
        c = cold(model, args, ids)
        pairs.append((w, c))
    return summary(pairs, hit)


def summary(pairs, hit) -> dict:
    med = lambda xs: statistics.median(xs)  # noqa: E731
    ratios = [w["s"] / c["s"] for w, c in pairs]
    return {"ttft_s": med([w["s"] for w, _ in pairs]), "ratio": med(ratios), "ratios": ratios,
            "cpu_ratio": med([w["cpu_s"] / c["cpu_s"] for w, c in pairs]),
            "load_s": med([w["load_s"] for w, _ in pairs]), "forward_s": med([w["forward_s"] for w, _ in pairs]),
            "cold_s": med([c["s"] for _, c in pairs]), "loaded": min(w["loaded"] for w, _ in pairs),
            "same_token": all(w["tok"] == c["tok"] for w, c in pairs), "hits": hit}


def hits(before: dict, after: dict) -> dict:
    h = {t: after["hits"][t] - before["hits"][t] for t in ("l1", "l2", "l3")}
    r0, r1 = before.get("remote"), after.get("remote")
    if r1:
        h["l4"] = r1["hits"] - (r0["hits"] if r0 else 0)
    return h


def load(args):
    from kvtier.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(dtype=_DTYPES[args.dtype])
    with torch.no_grad():  # warm-up: first-call allocations and kernel selection
        model(input_ids=torch.arange(64).unsqueeze(0))
    return model, tok


def child(args) -> int:
    """A new process: warm requests from L3 or from redis, each on a fresh cache (a fresh store:
    nothing in L1/L2), each paired with its own cold reference."""
    from kvtier.hf.cache import TieredCache

    model, tok = load(args)
    base = args.first_request  # requests of their own: no suffix found elsewhere
    kw = {"disk_path": args.disk} if args.child == "l3" else {"remote_url": args.redis_url}
    res = warm_runs(model, tok, args, range(base, base + args.repeat),
                    lambda: TieredCache(make_config(args, **kw), model))
    print(json.dumps(res))
    return 0


def run_child(args, kind: str, **extra) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--prompt", str(args.prompt),
           "--prefix", str(args.prefix), "--block-tokens", str(args.block_tokens),
           "--device-tokens", str(args.device_tokens), "--host-mb", str(args.host_mb), "--dtype", args.dtype,
           "--threads", str(args.threads or torch.get_num_threads()), "--repeat", str(args.repeat)]
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", v]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"{kind} child failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="short prompt (seconds)")
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--prefix", type=int, default=3072, help="shared leading tokens")
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--device-tokens", type=int, default=512, help="L1 budget per sequence and layer")
    ap.add_argument("--host-mb", type=int, default=512, help="L2 ring size")
    ap.add_argument("--dtype", choices=["auto", *sorted(_DTYPES)], default="auto",
                    help="model dtype; auto: kvtier.hardware.compute_dtype (bf16 only on a CPU with native bf16)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: leave as is)")
    ap.add_argument("--repeat", type=int, default=3, help="warm/cold pairs per case (median reported)")
    ap.add_argument("--masked", action="store_true", help="also warm-l2 with the split prefill off")
    ap.add_argument("--no-redis", action="store_true", help="skip warm-redis")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--child", choices=["l3", "redis"], help=argparse.SUPPRESS)
    ap.add_argument("--disk", help=argparse.SUPPRESS)
    ap.add_argument("--redis-url", help=argparse.SUPPRESS)
    ap.add_argument("--first-request", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dtype == "auto":
        from kvtier.hardware import compute_dtype

        args.dtype = str(compute_dtype("cpu")).removeprefix("torch.")
    if args.smoke:
        args.prompt, args.prefix, args.block_tokens, args.device_tokens = 256, 192, 32, 64
        args.threads = args.threads or 1
        args.repeat = 1
    if args.repeat < 1:
        raise SystemExit("--repeat must be >= 1")
    if not 0 < args.prefix < args.prompt or args.prefix % args.block_tokens:
        raise SystemExit("--prefix must be a multiple of --block-tokens in (0, --prompt)")
    if args.child:
        return child(args)

    from kvtier.hf.cache import TieredCache

    model, tok = load(args)
    r1, r2 = request(tok, args, 0), request(tok, args, 1)
    work = tempfile.mkdtemp(prefix="kvtier-bench-prefix-")
    disk = os.path.join(work, "l3")
    redis = None
    if not args.no_redis:
        if REDIS_SERVER is None:
            print("# warm-redis skipped: redis-server is not installed (apt-get install redis-server)")
        else:
            try:
                redis = start_redis_server(Path(work) / "redis")
            except RuntimeError as e:
                print(f"# warm-redis skipped: {e}")
    rows = []

    def emit(row: dict) -> None:
        rows.append(row)
        same = "-" if row["same_token"] is None else ("yes" if row["same_token"] else "NO")
        per = " ".join(f"{x:.3f}" for x in row["ratios"])
        print(f"{row['case']:<14} {row['ttft_s']:7.3f} {row['load_s']:7.3f} {row['forward_s']:7.3f} "
              f"{row['cold_s']:7.3f} {row['ratio']:7.3f} {row['cpu_ratio']:6.3f} {row['loaded']:7d} {same:>5}  "
              f"[{per}] {row['hits']}", flush=True)

    try:
        print(f"# prompt={args.prompt} prefix={args.prefix} block_tokens={args.block_tokens} "
              f"device_tokens={args.device_tokens} dtype={args.dtype} threads={torch.get_num_threads()} "
              f"repeat={args.repeat}")
        print(f"{'case':<14} {'TTFT s':>7} {'load s':>7} {'fwd s':>7} {'cold s':>7} {'x cold':>7} {'cpu x':>6} "
              f"{'loaded':>7} {'same':>5}  per pair x cold; hits", flush=True)
        c = cold(model, args, r2)
        emit({"case": "cold", "ttft_s": c["s"], "ratio": 1.0, "ratios": [1.0], "cpu_ratio": 1.0, "load_s": 0.0,
              "forward_s": c["forward_s"], "cold_s": c["s"], "loaded": 0, "same_token": True, "hits": {}})

        kw = {"disk_path": disk}
        if redis is not None:
            kw["remote_url"] = redis.url
        first = TieredCache(make_config(args, **kw), model)
        t0 = time.perf_counter()
        with torch.no_grad():  # the shared prefix is prefilled as its own chunk, as a system prompt is
            model(input_ids=r1[:, :args.prefix], cache=first)
            model(input_ids=r1[:, args.prefix:], cache=first, logits_to_keep=1)
        pop_s = time.perf_counter() - t0
        first.store.flush()  # write-through to L3/L4 done (it ran alongside, off the prefill path)
        emit({"case": "populate", "ttft_s": pop_s, "ratio": pop_s / c["s"], "ratios": [pop_s / c["s"]],
              "cpu_ratio": float("nan"),
              "load_s": 0.0, "forward_s": pop_s, "cold_s": c["s"], "loaded": 0, "same_token": None, "hits": {}})

        store = first.store
        r = args.repeat  # requests 1.. for warm-l2, then masked, l3, redis: each its own suffix
        same_store = lambda: TieredCache(make_config(args, **kw), model, store=store)  # noqa: E731
        res = warm_runs(model, tok, args, range(1, 1 + r), same_store, lambda _c: store.stats())
        emit({"case": "warm-l2", **res})
        if args.masked:
            with masked_prefill():
                res = warm_runs(model, tok, args, range(1 + r, 1 + 2 * r), same_store, lambda _c: store.stats())
            emit({"case": "warm-l2-masked", **res})
        first.close()  # the process's store closes: L3 files stay, as after a restart

        emit({"case": "warm-l3", **run_child(args, "l3", disk=disk, first_request=str(1 + 2 * r))})
        if redis is not None:
            emit({"case": "warm-redis", **run_child(args, "redis", redis_url=redis.url,
                                                    first_request=str(1 + 3 * r))})
    finally:
        if redis is not None:
            redis.kill()
        shutil.rmtree(work, ignore_errors=True)

    l3 = next(r for r in rows if r["case"] == "warm-l3")
    verdict = "met" if l3["ratio"] <= 0.4 else "NOT met"
    print(f"# target warm-l3 <= 0.4x cold: {verdict} ({l3['ratio']:.3f}x)"
          + (" [smoke: prompt too short to judge]" if args.smoke else ""))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
