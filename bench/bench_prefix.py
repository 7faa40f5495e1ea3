"""Time to first token with a shared prefix, on the real model (issue 7).

A 4k-token prompt whose first 3k tokens are a prefix another request already computed (a system
prompt, a document). Time to first token = the prefill forward that yields the first token's
logits (plus, when warm, ``TieredCache.load_prefix``):

  cold        full prefill, plain TieredCache (no L3/L4): the reference every ratio is to
  populate    request 1 (prefix, then its own suffix) with L3 + L4 write-through: what the first
              request pays; it leaves the prefix in the store, the L3 directory and redis
  warm-l2     request 2 in the same process and store (prefix blocks in L2, some in L1)
  warm-l3     request 2 in a NEW process on the same L3 directory (a restart)
  warm-redis  request 2 in a NEW process with no disk, the prefix coming from a redis-server
              started here (skipped when redis-server is not installed)

The new processes measure their own cold prefill too, so every ratio compares runs of one
process. Codec ``bf16`` (lossless for the bf16 model); ``same_token`` says whether the warm run's
first token equals the cold one's. Target: warm-l3 <= 0.4x cold.

    python bench/bench_prefix.py            # 4096-token prompt, 3072 shared
    python bench/bench_prefix.py --smoke    # seconds; run by `make bench-smoke`
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_CODEC = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp16"}


def make_config(args, **kw):
    from kvtier.config import KVTierConfig

    base = dict(block_tokens=args.block_tokens, hot_tokens=args.hot_tokens, codec=_CODEC[args.dtype],
                host_bytes=args.host_mb << 20, policy="lru", attention="dense", dtype=args.dtype)
    base.update(kw)
    return KVTierConfig(**base)


def request(tok, args, k: int):
    """Request ``k``: the shared prefix, then a suffix of its own (so no request finds another's
    suffix blocks). [1, prompt]."""
    from kvtier.integrations.model import text_ids

    suffix = args.prompt - args.prefix
    prefix = text_ids(tok, args.prefix, offset=0)
    return torch.cat((prefix, text_ids(tok, suffix, offset=args.prefix + (k + 1) * suffix)), 1)


@torch.no_grad()
def timed_prefill(model, cache, ids, load: bool):
    """(seconds to the first token's logits, tokens loaded, first token id)."""
    t0 = time.perf_counter()
    n = cache.load_prefix(ids) if load else 0
    logits = model(input_ids=ids[:, n:], cache=cache, logits_to_keep=1).logits  # [1, 1, vocab]
    tok = int(logits[0, -1].argmax())
    return time.perf_counter() - t0, n, tok


def cold(model, args, ids):
    from kvtier.integrations.cache import TieredCache

    cache = TieredCache(make_config(args), model)
    try:
        return timed_prefill(model, cache, ids, load=False)
    finally:
        cache.close()


def hits(before: dict, after: dict) -> dict:
    h = {t: after["hits"][t] - before["hits"][t] for t in ("l1", "l2", "l3")}
    r0, r1 = before.get("remote"), after.get("remote")
    if r1:
        h["l4"] = r1["hits"] - (r0["hits"] if r0 else 0)
    return h


def load(args):
    from kvtier.integrations.model import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(dtype=_DTYPES[args.dtype])
    with torch.no_grad():  # warm-up: first-call allocations and kernel selection
        model(input_ids=torch.arange(64).unsqueeze(0))
    return model, tok


def child(args) -> int:
    """A new process: warm request 2 from L3 or from redis, then its own cold reference."""
    from kvtier.integrations.cache import TieredCache

    model, tok = load(args)
    r2 = request(tok, args, 2 if args.child == "l3" else 3)
    kw = {"disk_path": args.disk} if args.child == "l3" else {"remote_url": args.redis_url}
    cache = TieredCache(make_config(args, **kw), model)
    before = cache.stats()
    warm_s, n, warm_tok = timed_prefill(model, cache, r2, load=True)
    after = cache.stats()
    cache.close()
    cold_s, _, cold_tok = cold(model, args, r2)
    print(json.dumps({"warm_s": warm_s, "cold_s": cold_s, "loaded": n, "same_token": warm_tok == cold_tok,
                      "hits": hits(before, after)}))
    return 0


class Redis:
    """A throw-away redis-server on a free loopback port (nothing saved to disk)."""

    def __init__(self, workdir: str) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", workdir],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.close()
        raise RuntimeError("redis-server did not answer PING")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def run_child(args, kind: str, **extra) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--prompt", str(args.prompt),
           "--prefix", str(args.prefix), "--block-tokens", str(args.block_tokens),
           "--hot-tokens", str(args.hot_tokens), "--host-mb", str(args.host_mb), "--dtype", args.dtype,
           "--threads", str(args.threads or torch.get_num_threads())]
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
    ap.add_argument("--hot-tokens", type=int, default=512, help="L1 budget per sequence and layer")
    ap.add_argument("--host-mb", type=int, default=512, help="L2 ring size")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: leave as is)")
    ap.add_argument("--no-redis", action="store_true", help="skip warm-redis")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--child", choices=["l3", "redis"], help=argparse.SUPPRESS)
    ap.add_argument("--disk", help=argparse.SUPPRESS)
    ap.add_argument("--redis-url", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompt, args.prefix, args.block_tokens, args.hot_tokens = 256, 192, 32, 64
        args.threads = args.threads or 1
    if not 0 < args.prefix < args.prompt or args.prefix % args.block_tokens:
        raise SystemExit("--prefix must be a multiple of --block-tokens in (0, --prompt)")
    if args.child:
        return child(args)

    from kvtier.integrations.cache import TieredCache

    model, tok = load(args)
    r1, r2 = request(tok, args, 0), request(tok, args, 1)
    work = tempfile.mkdtemp(prefix="kvtier-bench-prefix-")
    disk = os.path.join(work, "l3")
    redis = None
    if not args.no_redis:
        try:
            redis = Redis(work)
        except (FileNotFoundError, RuntimeError) as e:
            print(f"# warm-redis skipped: {e}")
    rows = []
    try:
        print(f"# prompt={args.prompt} prefix={args.prefix} block_tokens={args.block_tokens} "
              f"hot_tokens={args.hot_tokens} dtype={args.dtype} threads={torch.get_num_threads()}")
        cold_s, _, cold_tok = cold(model, args, r2)
        rows.append({"case": "cold", "ttft_s": cold_s, "ratio": 1.0, "loaded": 0, "same_token": True, "hits": {}})

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
        rows.append({"case": "populate", "ttft_s": pop_s, "ratio": pop_s / cold_s, "loaded": 0,
                     "same_token": None, "hits": {}})

        second = TieredCache(make_config(args, **kw), model, store=first.store)
        before = first.store.stats()
        s, n, t = timed_prefill(model, second, r2, load=True)
        rows.append({"case": "warm-l2", "ttft_s": s, "ratio": s / cold_s, "loaded": n,
                     "same_token": t == cold_tok, "hits": hits(before, first.store.stats())})
        first.close()  # the process's store closes: L3 files stay, as after a restart

        res = run_child(args, "l3", disk=disk)
        rows.append({"case": "warm-l3", "ttft_s": res["warm_s"], "ratio": res["warm_s"] / res["cold_s"],
                     "loaded": res["loaded"], "same_token": res["same_token"], "hits": res["hits"]})
        if redis is not None:
            res = run_child(args, "redis", redis_url=redis.url)
            rows.append({"case": "warm-redis", "ttft_s": res["warm_s"], "ratio": res["warm_s"] / res["cold_s"],
                         "loaded": res["loaded"], "same_token": res["same_token"], "hits": res["hits"]})
    finally:
        if redis is not None:
            redis.close()
        shutil.rmtree(work, ignore_errors=True)

    print(f"{'case':<11} {'TTFT s':>8} {'x cold':>7} {'loaded':>7} {'same':>5}  hits")
    for r in rows:
        same = "-" if r["same_token"] is None else ("yes" if r["same_token"] else "NO")
        print(f"{r['case']:<11} {r['ttft_s']:8.3f} {r['ratio']:7.3f} {r['loaded']:7d} {same:>5}  {r['hits']}")
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
