"""Soak: many conversations on one store with L3, the process SIGKILLed at random moments and
restarted on the same directory, again and again; nothing synced may be lost or served wrong.

Each round forks a worker that opens a KVStore on --dir (lossless fp16 records, small L1 and L2
so blocks keep moving to L3, content-addressed blocks written through to L3) and:
  1. verifies the conversations earlier workers reported synced: a fresh sequence attaches
     their prefix from L3 (attach_prefix) and every block is compared bit-exact with the KV it
     was built from (K/V are a pure function of the token ids before them, so any block can be
     checked by anyone); a block missing or different counts as lost / served corrupt;
  2. runs conversations: families share a prefix, each appends blocks and partial blocks,
     attends sparsely (select + gather_blocks, checked bit-exact too), drops finished
     conversations (keeping their prefix in L3, as a server keeps reusable prefixes), and every
     few steps flushes, syncs L3 and reports which blocks are now durable;
while the parent SIGKILLs it after a random delay. The directory's lock must be taken over by
the next worker every time. At the end the kept records are expired and compacted away: disk
use returns to what live conversations need (none).

Reported (JSON): rounds, kills, conversations, blocks verified, blocks lost and corrupt blocks
served (both must be 0), bytes lost, GB written to and read from L3, lock takeovers, disk bytes
before and after reclaiming.

With --redis URL (a redis-server on loopback; --redis auto starts one when `redis-server` is
installed) the store also writes its content blocks through to L4, and each worker checks every
conversation reported synced a second time from L4 alone (a store without L3 attaching the
prefix from Redis), bit-exact; --redis-kill-every N SIGKILLs and restarts the server (started
here, no persistence: it comes back empty, as a crashed cache node) every N rounds, so L4 goes
away under the store and comes back. Reported too: L4 blocks verified, lost and corrupt (a
block lost from L4 is expected only across a Redis restart; none may be corrupt), Redis restarts.

    python bench/bench_soak.py --smoke          # ~15 s (CI)
    python bench/bench_soak.py --seconds 600 --redis auto --redis-kill-every 5   # the long run
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.redis_server import REDIS_SERVER, start_redis_server  # noqa: E402  (the tests' loopback server)

LAYERS, KV_HEADS, HEAD_DIM, BT = 2, 2, 32, 16
BLOCK_BYTES = 2 * KV_HEADS * BT * HEAD_DIM * 2  # fp16 K and V of one block of one layer
_CTX = mp.get_context("fork")


def conv_ids(family: int, conv: int, n_blocks: int, prefix_blocks: int) -> np.ndarray:
    """Token ids of a conversation: its family's shared prefix, then its own tokens."""
    pre = (np.arange(prefix_blocks * BT, dtype=np.int64) * 7 + family * 1_000_003) % 50_000
    own = (np.arange((n_blocks - prefix_blocks) * BT, dtype=np.int64) * 13 + conv * 999_983) % 50_000
    return np.concatenate([pre, own])


def block_kv(ids: np.ndarray, b: int, layer: int) -> torch.Tensor:
    """[2, kv_heads, BT, head_dim] fp16 KV of block b: a function of ids[:(b+1)*BT] only."""
    h = hashlib.blake2b(ids[:(b + 1) * BT].tobytes() + bytes([layer]), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(h, "little"))
    return torch.randn(2, KV_HEADS, BT, HEAD_DIM, generator=g).half()


def open_store(path: str | None, redis: tuple[str, str] | None = None):
    """The soak's store: L3 on ``path`` (None: no L3), L4 at ``redis`` = (url, key prefix) if given."""
    from kvtier.config import KVTierConfig
    from kvtier.store import KVStore

    url, prefix = redis or (None, "kvtier:")
    # small L2 so that blocks keep moving to L3; without L3 (the L4 check) L2 holds what it reads
    cfg = KVTierConfig(block_tokens=BT, device_tokens=4 * BT, host_bytes=(96 << 10) if path else (64 << 20), codec="fp16", policy="lru",
                       max_sequences=8, disk_path=path, disk_bytes=512 << 20, disk_segment_bytes=1 << 20,
                       write_through=True, durability="close", remote_url=url, remote_key_prefix=prefix)
    return KVStore(cfg, num_layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float16,
                   fingerprint="soak-model")


def verify(st, synced: list) -> tuple[int, int, int]:
    """Attach each synced conversation's blocks into a fresh sequence of ``st`` and compare every
    block bit-exact with the KV it was built from: (blocks verified, lost, corrupt), per layer."""
    verified = lost = corrupt = 0
    for fam, conv, nb, pb in synced:
        ids = conv_ids(fam, conv, nb, pb)[:nb * BT]
        s = st.add_sequence()
        got = st.attach_prefix(s, ids) // BT
        lost += max(0, nb - got) * LAYERS
        for layer in range(LAYERS):
            if got:
                K, V = st.gather(s, layer)  # every block, from whichever tier holds it
                exp = torch.cat([block_kv(ids, b, layer) for b in range(got)], dim=2)
                corrupt += 0 if (torch.equal(K, exp[0]) and torch.equal(V, exp[1])) else 1
                verified += got
        st.drop_sequence(s, keep_prefix=True)
    return verified, lost, corrupt


def _worker(path: str, wfd: int, seed: int, synced: list, redis: tuple[str, str] | None,
            synced_l4: list) -> None:
    """One process lifetime (runs until killed). Reports lines on ``wfd``:
    R pid | V verified lost corrupt | W l4 verified lost corrupt | S family conv blocks prefix |
    M l3_written l3_read convs disk_bytes."""
    rng = random.Random(seed)

    def say(line: str) -> None:
        os.write(wfd, (line + "\n").encode())

    st = open_store(path, redis)
    say(f"R {os.getpid()}")
    say("V %d %d %d" % verify(st, synced[-40:]))  # the most recent: each restart checks a window
    if redis is not None:
        with open_store(None, redis) as only_l4:  # nothing local: every block comes from Redis
            checked = verify(only_l4, synced_l4[-16:])  # a smaller window: each restart pays both
            say("W %d %d %d %d" % (*checked, only_l4.l4.stats()["bytes_out"]))
    live: dict[int, tuple] = {}  # seq -> (family, conv, ids, target blocks, prefix blocks)
    conv_n, step = seed * 1000, 0
    while True:
        if len(live) < 6 and rng.random() < 0.5:
            fam, pb = rng.randrange(4), rng.randint(1, 4)
            nb = rng.randint(pb + 2, pb + 24)
            conv_n += 1
            ids = conv_ids(fam, conv_n, nb, pb)
            s = st.add_sequence()
            st.note_tokens(s, ids)
            live[s] = (fam, conv_n, ids, nb, pb)
        for s, (fam, conv, ids, nb, pb) in list(live.items()):
            have = st.seq_len(s, 0)
            if have >= nb * BT:
                st.drop_sequence(s, keep_prefix=True)
                del live[s]
                continue
            b, off = divmod(have, BT)
            take = BT - off if rng.random() < 0.7 else rng.randint(1, BT - off)  # whole or partial blocks
            for layer in range(LAYERS):
                kv = block_kv(ids, b, layer)[:, :, off:off + take]
                st.append(s, layer, kv[0], kv[1])
            if have + take >= 2 * BT and rng.random() < 0.3:  # a sparse read, checked bit-exact
                sealed = (have + take) // BT - ((have + take) % BT == 0)
                pick = sorted(rng.sample(range(sealed), min(2, sealed))) if sealed else []
                for layer in range(LAYERS):
                    K, V, pos = st.gather_blocks(s, layer, pick)
                    exp = torch.cat([block_kv(ids, bb, layer) for bb in range(b + 1)], dim=2)[:, :, :have + take]
                    if not (torch.equal(K, exp[0][:, pos]) and torch.equal(V, exp[1][:, pos])):
                        say("C 1")
        st.end_step()
        step += 1
        if step % 25 == 0:
            st.flush()
            st.l3.sync()
            l3 = st.l3.stats()
            # L4 took every publish of this process (a failed or skipped round trip is a miss, not
            # an error): only then do its blocks count as synced to L4 too
            l4 = st.l4.stats() if st.l4 is not None else None
            l4_ok = int(l4 is not None and l4["errors"] + l4["skipped"] + l4["rejected"] == 0)
            for s, (fam, conv, ids, nb, pb) in live.items():
                full = (st.seq_len(s, 0) - 1) // BT  # sealed blocks: the open one is not written through yet
                if full > 0:
                    say(f"S {fam} {conv} {full} {pb} {l4_ok}")
            say(f"M {l3['bytes_in']} {l3['bytes_out']} {conv_n - seed * 1000} {l3['disk_bytes']} "
                f"{l4['bytes_in'] if l4 else 0} {l4['bytes_out'] if l4 else 0}")


def soak(path: str, seconds: float, seed: int = 0, min_delay: float = 0.3, max_delay: float = 2.5,
         redis: tuple[str, str] | None = None, restart_redis=None, redis_kill_every: int = 0) -> dict:
    """The kill-and-restart loop (see the module docstring). ``redis``: (url, key prefix) of L4;
    ``restart_redis()``: SIGKILL and restart that server (empty), every ``redis_kill_every`` rounds."""
    from kvtier.tiers import DiskTier

    rng = random.Random(seed)
    synced: dict[tuple, tuple] = {}  # (family, conv) -> (family, conv, blocks, prefix blocks)
    # the same, for what was published to the Redis running now (a restart empties it)
    synced_l4: dict[tuple, tuple] = {}
    res = dict(rounds=0, kills=0, lock_takeovers=0, conversations=0, blocks_verified=0, blocks_lost=0,
               corrupt_served=0, l3_bytes_written=0, l3_bytes_read=0, max_disk_bytes=0, l4=redis is not None,
               l4_blocks_verified=0, l4_blocks_lost=0, l4_corrupt_served=0, redis_restarts=0,
               l4_bytes_written=0, l4_bytes_read=0)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if restart_redis is not None and redis_kill_every and res["rounds"] and res["rounds"] % redis_kill_every == 0:
            restart_redis()
            res["redis_restarts"] += 1
            synced_l4.clear()
        r, w = os.pipe()
        p = _CTX.Process(target=_worker, args=(path, w, rng.randrange(1 << 30), list(synced.values()), redis,
                                               list(synced_l4.values())))
        p.start()
        os.close(w)
        buf, seen_m = b"", (0, 0, 0, 0, 0)
        deadline = None
        with os.fdopen(r, "rb", buffering=0) as f:
            os.set_blocking(r, False)
            while True:
                if deadline is not None and time.monotonic() >= deadline:
                    break
                if not p.is_alive():
                    break
                try:
                    chunk = f.read(65536)
                except BlockingIOError:
                    chunk = None
                if chunk:
                    buf += chunk
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        kind, *vals = line.decode().split()
                        if kind == "R":
                            res["lock_takeovers"] += res["rounds"] > 0
                            with open(os.path.join(path, "LOCK")) as lf:
                                assert lf.read().strip() == vals[0], "lock file names another process"
                        elif kind == "V":
                            res["blocks_verified"] += int(vals[0])  # per layer, as lost
                            res["blocks_lost"] += int(vals[1])
                            res["corrupt_served"] += int(vals[2])
                            if redis is None:
                                deadline = time.monotonic() + rng.uniform(min_delay, max_delay)
                        elif kind == "W":
                            res["l4_blocks_verified"] += int(vals[0])
                            res["l4_blocks_lost"] += int(vals[1])
                            res["l4_corrupt_served"] += int(vals[2])
                            res["l4_bytes_read"] += int(vals[3])
                            deadline = time.monotonic() + rng.uniform(min_delay, max_delay)
                        elif kind == "S":
                            fam, conv, nb, pb, l4_ok = map(int, vals)
                            for book in (synced, synced_l4) if l4_ok else (synced,):
                                prev = book.get((fam, conv))
                                if prev is None or prev[2] < nb:
                                    book[(fam, conv)] = (fam, conv, nb, pb)
                        elif kind == "M":
                            seen_m = (int(vals[0]), int(vals[1]), int(vals[2]), int(vals[4]), int(vals[5]))
                            res["max_disk_bytes"] = max(res["max_disk_bytes"], int(vals[3]))
                        elif kind == "C":
                            res["corrupt_served"] += 1
                else:
                    time.sleep(0.01)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            res["kills"] += 1
        p.join()
        if p.exitcode not in (-signal.SIGKILL,):
            raise RuntimeError(f"soak worker exited with {p.exitcode} (not killed): it failed")
        res["rounds"] += 1
        res["l3_bytes_written"] += seen_m[0]
        res["l3_bytes_read"] += seen_m[1]
        res["conversations"] += seen_m[2]
        res["l4_bytes_written"] += seen_m[3]
        res["l4_bytes_read"] += seen_m[4]
    # the last check: every synced conversation, then give the disk back
    final = _CTX.Process(target=_verify_all, args=(path, list(synced.values()), w2 := os.pipe(), redis,
                                                   list(synced_l4.values())))
    r2, wfd = w2
    final.start()
    os.close(wfd)
    with os.fdopen(r2, "rb") as f:
        out = f.read().decode().split()
    final.join()
    if final.exitcode != 0 or len(out) != 6:
        raise RuntimeError(f"final verification failed ({final.exitcode}): {out}")
    (res["final_blocks_verified"], res["final_blocks_lost"], res["final_corrupt"], res["final_l4_blocks_verified"],
     res["final_l4_blocks_lost"], res["final_l4_corrupt"]) = map(int, out)
    res["synced_conversations"] = len(synced)
    with DiskTier(path, capacity_bytes=512 << 20, segment_bytes=1 << 20) as t:
        res["disk_bytes_before_reclaim"] = t.disk_bytes
        res["kept_records"] = len(t)
        t.expire(max_bytes=0)  # no conversation is live: every kept prefix may go
        t.compact()
        res["disk_bytes_after_reclaim"] = t.disk_bytes
        res["records_after_reclaim"] = len(t)
    res["bytes_lost"] = (res["blocks_lost"] + res["final_blocks_lost"]) * BLOCK_BYTES
    res["GB_moved"] = (res["l3_bytes_written"] + res["l3_bytes_read"] + res["l4_bytes_written"]
                       + res["l4_bytes_read"]) / 1e9
    return res


def _verify_all(path: str, synced: list, pipe, redis: tuple[str, str] | None, synced_l4: list) -> None:
    r, w = pipe
    os.close(r)
    with open_store(path) as st:  # L3 alone: what the directory holds
        out = verify(st, synced)
    l4 = (0, 0, 0)
    if redis is not None:
        with open_store(None, redis) as st:  # L4 alone
            l4 = verify(st, synced_l4)
            st.l4.delete_many(list(st.l4.keys()))  # the run's keys (its own prefix) go
    os.write(w, " ".join(map(str, out + l4)).encode())
    os.close(w)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="about 15 s (CI)")
    ap.add_argument("--seconds", type=float, default=300.0, help="how long to keep killing and restarting")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="directory for L3 (default: a temp dir, removed after)")
    ap.add_argument("--json", action="store_true", help="print only the JSON")
    ap.add_argument("--redis", default=None, metavar="URL",
                    help="L4: a Redis URL, or 'auto' to start a redis-server on loopback here (if installed)")
    ap.add_argument("--redis-kill-every", type=int, default=0, metavar="N",
                    help="with --redis auto: SIGKILL and restart the server every N rounds (0: never)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.seconds = 8.0
    if a.seconds <= 0:
        raise SystemExit("--seconds must be > 0")
    if a.redis_kill_every < 0 or (a.redis_kill_every and a.redis != "auto"):
        raise SystemExit("--redis-kill-every must be >= 0, and needs --redis auto (a server this run owns)")
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="kvtier-soak-", dir=a.dir)
    server = None
    try:
        redis = None
        if a.redis == "auto":
            if REDIS_SERVER is None:
                raise SystemExit("--redis auto needs redis-server (Debian package redis-server)")
            server = start_redis_server(Path(root) / "redis")
            redis = (server.url, f"soak{a.seed}:")
        elif a.redis is not None:
            redis = (a.redis, f"soak{a.seed}-{os.getpid()}:")
        t0 = time.perf_counter()
        res = soak(os.path.join(root, "l3"), a.seconds, a.seed, redis=redis,
                   restart_redis=server.restart if server is not None else None,
                   redis_kill_every=a.redis_kill_every)
        res["wall_s"] = time.perf_counter() - t0
    finally:
        if server is not None:
            server.kill()
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(res, indent=None if a.json else 1))
    ok = (res["bytes_lost"] == 0 and res["corrupt_served"] == 0 and res["final_corrupt"] == 0
          and res["l4_corrupt_served"] == 0 and res["final_l4_corrupt"] == 0)
    if not a.json:
        print(("PASS" if ok else "FAIL") + f": {res['kills']} kills, {res['final_blocks_verified']} blocks verified "
              f"at the end, {res['bytes_lost']} bytes lost")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
