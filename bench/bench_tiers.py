"""Tier bandwidth, each figure a ratio to a reference measured in the same run.

  L1 DeviceTier put/get       vs  tensor.copy_ of the same bytes on the same device
  L2 HostTier put/get_into    vs  tensor.copy_ of the same bytes (host)
     HostTier get (owned)     vs  bytes(...) of the same bytes (a fresh allocation each time)
  L3 DiskTier put_many        vs  raw sequential os.write of the same bytes, same sync points
     DiskTier get_many        vs  raw sequential read of the same bytes (f.read per record,
                                  a batch of owned bytes held at a time, as get_many returns),
                                  warm (page cache) and cold (pages dropped with
                                  posix_fadvise(DONTNEED) after fdatasync, or O_DIRECT); also
                                  vs one os.preadv a batch (_vs_preadv: a bound no Python tier reaches)
     DiskTier get             vs  the same f.read per record: one get() a record (get_warm_*;
                                  the store's swap-in batches through get_many)
     DiskTier get_into        vs  raw sequential readinto, both into one preallocated buffer
     warm reads also as a ratio of the reading thread's CPU time (_cpu: what a loaded machine's
     scheduling does not inflate), and with a writer thread appending meanwhile (_with_writer:
     the tier written through put_many, the raw reference to another file); base_*: the same
     reads (and writer) through another DiskTier in the same run, where a caller passes one
     (research/bench_tiers_base.py: an older revision's)
     crc: GB/s of the record CRC beside zlib's and CRC32C packages' (when installed) and a copy
     L3_reopen: a directory of 1M small records reopened from its checkpoint (and, where a caller
     passes one, another DiskTier's alternated), each in a fresh interpreter: seconds, us a record, RSS growth;
     and the checkpoint written of it before (seconds, the longest tier-lock hold, a reader's gets)
     with lz4: blocks compressed before put and decompressed after get (the store's byte
     stage), GB/s of uncompressed bytes, against the same raw references.
     L3_small: the same for small records (--small-kib, one layer's quantized block), where
     the per-call cost rather than the copy decides.
     L3_compaction: p50/p99 of two step shapes while background compaction empties segments
     3/4 dead and, alternated with it, on the same tier without compaction, for this tree (and
     another DiskTier where a caller passes one): a decode step of an 8B model (32 layers x a get_many of 8, then a put_many of one block
     per layer; the target is judged on it) and a micro step (one put, three gets: tens of
     microseconds, where OS jitter alone puts p99 at several times p50); the compactor's share
     of the time. The p99 <= 2x p50 target is judged as is where the machine's decode steps
     meet it without compaction, else against them (the output says which: see bench_compaction).
     CAUSES lines: where the decode steps' time went, for the middle half and for those that set
     p99, with and without compaction (CPU, run-queue wait, sleep; time inside acquisitions of
     the tier lock and the write lock; GC), and the compactor's lock holds, GC and CPU/run-queue
     time (see _StepProbe); each group's step count in parentheses. The kernel's share of the
     CPU comes from getrusage, whose user/kernel split most kernels sample at the scheduler tick
     (4 ms at HZ=250, longer than a step): over the p99 group's ~20 steps it rests on a handful
     of ticks, so where the kernel time goes is a question for perf, not for this line.

  L4_<size>: the remote tiers beside L3, records of 4 KiB and --block-kib (256 KiB), each on a
     server this script starts on loopback (a redis-server; a mooncake_master + store server):
     put_many/get_many GB/s in batches of --batch, and p50/p99 us of one put()/get(); ratios
     Mooncake/Redis and Mooncake/L3 of the same run (a tier whose server cannot start is left out).

Targets (printed as VERDICT lines, PASS/MISS, never asserted: timing depends on the machine):
  L2 >= 0.5x copy bandwidth; L3 >= 0.7x raw file write and read when records go raw, small
  records too, with a writer too; a decode step's p99 <= 2x its p50 while compaction runs;
  reopen < 1 us a record.

Usage: python bench/bench_tiers.py [--smoke] [--block-kib 256] [--total-mib 256] [--dir PATH]
"""
from __future__ import annotations

import argparse
import gc
import resource
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable

import lz4.block
import torch

from kvtier.tiers import DeviceTier, DiskTier, HostTier


def best_of(fns: dict, repeat: int) -> dict:
    """Best seconds per function over ``repeat`` interleaved rounds, after one warm-up each.

    Interleaving keeps a reference and what is compared with it under the same machine load.
    """
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, fn in fns.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def drop_cache(paths: list[str]) -> bool:
    """Evict the files' pages from the page cache; False where the OS does not allow it."""
    ok = hasattr(os, "posix_fadvise")
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            if ok:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return ok


def bench_l1(blocks: list[torch.Tensor], device: str, repeat: int) -> dict:
    n, shape = len(blocks), tuple(blocks[0].shape)
    nbytes = n * blocks[0].numel() * blocks[0].element_size()
    tier = DeviceTier(shape, num_slots=n, dtype=blocks[0].dtype, device=device)
    src = [b.to(device) for b in blocks]
    ref_dst = torch.empty((n, *shape), dtype=blocks[0].dtype, device=device)
    out = torch.empty_like(ref_dst)
    keys = [f"b{i}" for i in range(n)]

    def ref():
        for i in range(n):
            ref_dst[i].copy_(src[i])

    def put():
        for k, x in zip(keys, src):
            tier.put(k, x)

    def get():
        for i, k in enumerate(keys):
            out[i].copy_(tier.get_tensor(k))

    t = best_of({"ref": ref, "put": put, "get": get}, repeat)
    assert torch.equal(out, ref_dst)
    return {"copy_GBps": gbps(nbytes, t["ref"]), "put_ratio": t["ref"] / t["put"], "get_ratio": t["ref"] / t["get"]}


def bench_l2(blocks: list[bytes], repeat: int) -> dict:
    n, bs = len(blocks), len(blocks[0])
    nbytes = n * bs
    tier = HostTier(int(nbytes * 1.25) + (1 << 20), spill=None, pin_memory=False)
    src = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blocks]
    ref_dst = torch.empty((n, bs), dtype=torch.uint8)
    out = torch.empty((n, bs), dtype=torch.uint8)
    keys = [f"b{i}" for i in range(n)]

    def ref():
        for i in range(n):
            ref_dst[i].copy_(src[i])

    def ref_owned():
        for b in src:
            b.numpy().tobytes()

    def put_tensor():
        for k, x in zip(keys, src):
            assert tier.put(k, x)

    def put_bytes():
        for k, b in zip(keys, blocks):
            assert tier.put(k, b)

    def get_into():
        for i, k in enumerate(keys):
            tier.get_into(k, out[i])

    def get_owned():
        for k in keys:
            tier.get(k)

    t = best_of({"ref": ref, "put_tensor": put_tensor, "ref_owned": ref_owned, "put_bytes": put_bytes,
                 "get_into": get_into, "get_owned": get_owned}, repeat)
    assert out.numpy().tobytes() == b"".join(blocks)
    return {"copy_GBps": gbps(nbytes, t["ref"]), "put_tensor_ratio": t["ref"] / t["put_tensor"],
            "put_bytes_ratio": t["ref"] / t["put_bytes"], "get_into_ratio": t["ref"] / t["get_into"],
            "owned_copy_GBps": gbps(nbytes, t["ref_owned"]),
            "get_owned_ratio_vs_bytes_copy": t["ref_owned"] / t["get_owned"]}


def raw_write(path: str, blocks: list[bytes], batch: int) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for i, b in enumerate(blocks):
        os.write(fd, b)
        if (i + 1) % batch == 0 or i + 1 == len(blocks):
            os.fdatasync(fd)
    os.close(fd)
    return time.perf_counter() - t0


def raw_read(path: str, bs: int, n: int, batch: int) -> float:
    """Sequential reads, one owned bytes per record, held a batch at a time like get_many's."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        for i in range(0, n, batch):
            got = [f.read(bs) for _ in range(min(batch, n - i))]
            assert all(len(g) == bs for g in got)
    return time.perf_counter() - t0


def raw_preadv(path: str, bs: int, n: int, batch: int) -> float:
    """A batch of records in one preadv into fresh buffers (owned, as get_many's values are)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            bufs = [bytearray(bs) for _ in range(min(batch, n - i))]
            assert os.preadv(fd, bufs, i * bs) == len(bufs) * bs
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def raw_readinto(path: str, bs: int, n: int, buf: bytearray) -> float:
    """Sequential reads into one preallocated buffer (the reference for get_into)."""
    mv = memoryview(buf)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        for i in range(n):
            f.readinto(mv[(i % 16) * bs:(i % 16 + 1) * bs])
    return time.perf_counter() - t0


def raw_read_direct(path: str, bs: int, n: int) -> float | None:
    """O_DIRECT sequential read into an aligned (mmap) buffer; None where unsupported."""
    if not hasattr(os, "O_DIRECT") or bs % 4096:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return None
    buf = mmap.mmap(-1, bs)
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            os.readv(fd, [buf])
        return time.perf_counter() - t0
    except OSError:
        return None
    finally:
        os.close(fd)
        buf.close()


def read_under_writes(root: str, tiers: dict, blocks: list[bytes], rawp: str, batch: int, repeat: int, raw_read,
                      tier_read) -> tuple[dict[str, float], dict[str, float]]:
    """Best warm-read seconds, wall and the reading thread's CPU, of the raw file ("raw") and of
    each tier in ``tiers`` while a
    writer thread appends the same kind of records (raw: os.write + fdatasync per batch to
    another file; a tier: put_many of a quarter as many keys over and over, so that compaction
    runs too, and sync), alternated round by round."""

    n, bs = len(blocks), len(blocks[0])
    wkeys = [f"w{i}" for i in range(max(1, n // 4))]

    def writer(stop: threading.Event, t) -> None:
        fd = -1 if t is not None else os.open(os.path.join(root, "raw-w.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                              0o600)
        i = 0
        while not stop.is_set():
            chunk = [blocks[(i + j) % n] for j in range(batch)]
            if t is not None:
                t.put_many([(wkeys[(i + j) % len(wkeys)], c) for j, c in enumerate(chunk)])
                t.sync()
            else:
                for c in chunk:
                    os.write(fd, c)
                os.fdatasync(fd)
                if i * bs > (64 << 20):
                    os.lseek(fd, 0, os.SEEK_SET)
            i += batch
        if fd >= 0:
            os.close(fd)

    best = {name: float("inf") for name in ("raw", *tiers)}
    cpu = dict(best)
    for _ in range(repeat):
        for name in best:
            t = tiers.get(name)
            stop = threading.Event()
            w = threading.Thread(target=writer, args=(stop, t), daemon=True)
            w.start()
            try:
                c0 = time.thread_time()
                best[name] = min(best[name], tier_read(t) if t is not None else raw_read(rawp, bs, n, batch))
                cpu[name] = min(cpu[name], time.thread_time() - c0)
            finally:
                stop.set()
                w.join()
    for t in tiers.values():
        t.delete_many(wkeys)
    return best, cpu


def bench_l3(root: str, blocks: list[bytes], batch: int, compress: bool, repeat: int, base=None) -> dict:
    n, bs = len(blocks), len(blocks[0])
    nbytes = n * bs
    seg = 64 << 20  # DiskTier's default segment size
    res: dict = {}
    rawp = os.path.join(root, "raw.bin")
    payload = [lz4.block.compress(b, store_size=False) for b in blocks] if compress else blocks
    stored = sum(len(p) for p in payload)
    if compress:
        res["lz4_ratio"] = nbytes / stored

    def tier_write() -> float:
        d = os.path.join(root, "tier")
        shutil.rmtree(d, ignore_errors=True)
        t0 = time.perf_counter()
        t = DiskTier(d, capacity_bytes=4 * nbytes + 16 * seg, segment_bytes=seg, durability="batch")
        for i in range(0, n, batch):
            chunk = blocks[i:i + batch]
            if compress:
                chunk = [lz4.block.compress(b, store_size=False) for b in chunk]
            assert all(t.put_many([(f"b{i + j}", c) for j, c in enumerate(chunk)]))
        t.close()
        return time.perf_counter() - t0

    keys = [f"b{i}" for i in range(n)]

    def tier_read(t: DiskTier) -> float:
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            got = t.get_many(keys[i:i + batch])
            if compress:
                got = [lz4.block.decompress(g, uncompressed_size=bs) for g in got]
            assert all(g is not None and len(g) == bs for g in got)
        return time.perf_counter() - t0

    def tier_get(t: DiskTier) -> float:
        """One get() per record, a batch of values held at a time (single-block reads)."""
        get = t.get
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            got = [get(k) for k in keys[i:i + batch]]
            if compress:
                got = [lz4.block.decompress(g, uncompressed_size=bs) for g in got]
            assert all(g is not None and len(g) == bs for g in got)
        return time.perf_counter() - t0

    w_raw = w_tier = float("inf")
    for _ in range(repeat):  # interleaved: both see the same disk and machine load
        w_raw = min(w_raw, raw_write(rawp, blocks, batch))
        w_tier = min(w_tier, tier_write())
    res.update(raw_write_GBps=gbps(nbytes, w_raw), write_ratio=w_raw / w_tier)

    t = DiskTier(os.path.join(root, "tier"), capacity_bytes=4 * nbytes + 16 * seg, segment_bytes=seg)
    tier_read(t)
    raw_read(rawp, bs, n, batch)
    buf = bytearray(16 * bs)

    def tier_read_into() -> float:
        mv = memoryview(buf)
        t0 = time.perf_counter()
        for i, k in enumerate(keys):
            assert t.get_into(k, mv[(i % 16) * bs:(i % 16 + 1) * bs]) == len(payload[i])
        return time.perf_counter() - t0

    tb = None  # the same records read through the other DiskTier (``base``: a module with one)
    if base is not None and not compress:
        bdir = os.path.join(root, "tier-base")
        shutil.rmtree(bdir, ignore_errors=True)
        os.makedirs(bdir)
        names = sorted(name for name in os.listdir(os.path.join(root, "tier")) if name.startswith("seg-"))
        for name in names:  # sealed segments hard-linked; the last, which both tiers append to, copied
            (shutil.copyfile if name == names[-1] else os.link)(os.path.join(root, "tier", name),
                                                                 os.path.join(bdir, name))
        tb = base.DiskTier(bdir, capacity_bytes=4 * nbytes + 16 * seg, segment_bytes=seg)
        tier_read(tb)
    fns = {"raw": lambda: raw_read(rawp, bs, n, batch), "many": lambda: tier_read(t), "get": lambda: tier_get(t)}
    if not compress:
        fns.update(raw_preadv=lambda: raw_preadv(rawp, bs, n, batch), raw_into=lambda: raw_readinto(rawp, bs, n, buf),
                   into=tier_read_into)
    if tb is not None:
        fns.update(base_many=lambda: tier_read(tb), base_get=lambda: tier_get(tb))
    wall = dict.fromkeys(fns, float("inf"))
    cpu = dict(wall)
    for _ in range(repeat):  # interleaved: all see the same machine load
        for name, fn in fns.items():
            c0 = time.thread_time()
            wall[name] = min(wall[name], fn())
            cpu[name] = min(cpu[name], time.thread_time() - c0)
    # cpu: the reading thread's CPU time, which a loaded machine's scheduling does not inflate
    res.update(raw_read_warm_GBps=gbps(nbytes, wall["raw"]), read_warm_ratio=wall["raw"] / wall["many"],
               read_warm_ratio_cpu=cpu["raw"] / cpu["many"], get_warm_ratio=wall["raw"] / wall["get"],
               get_warm_ratio_cpu=cpu["raw"] / cpu["get"])
    if tb is not None:
        res.update(base_read_warm_ratio=wall["raw"] / wall["base_many"],
                   base_read_warm_ratio_cpu=cpu["raw"] / cpu["base_many"],
                   base_get_warm_ratio=wall["raw"] / wall["base_get"],
                   base_get_warm_ratio_cpu=cpu["raw"] / cpu["base_get"])
    if not compress:
        res.update(read_into_warm_ratio=wall["raw_into"] / wall["into"],
                   read_warm_ratio_vs_preadv=wall["raw_preadv"] / wall["many"])
        tiers = {"new": t} if tb is None else {"new": t, "base": tb}
        for what, reader in (("read", tier_read), ("get", tier_get)):
            w, wc = read_under_writes(root, tiers, blocks, rawp, batch, repeat, raw_read, reader)
            res[f"{what}_warm_ratio_with_writer"] = w["raw"] / w["new"]
            res[f"{what}_warm_ratio_with_writer_cpu"] = wc["raw"] / wc["new"]
            if "base" in w:
                res[f"base_{what}_warm_ratio_with_writer"] = w["raw"] / w["base"]
                res[f"base_{what}_warm_ratio_with_writer_cpu"] = wc["raw"] / wc["base"]
    if tb is not None:
        tb.close()
        shutil.rmtree(os.path.join(root, "tier-base"), ignore_errors=True)
    t.close()

    segs = [os.path.join(root, "tier", f) for f in os.listdir(os.path.join(root, "tier")) if f.startswith("seg-")]
    if drop_cache(segs + [rawp]):
        r_raw_cold = r_tier_cold = float("inf")
        for _ in range(repeat):
            drop_cache(segs + [rawp])
            r_raw_cold = min(r_raw_cold, raw_read(rawp, bs, n, batch))
            drop_cache(segs + [rawp])
            t = DiskTier(os.path.join(root, "tier"), capacity_bytes=4 * nbytes + 16 * seg, segment_bytes=seg)
            r_tier_cold = min(r_tier_cold, tier_read(t))
            t.close()
        drop_cache([rawp])
        r_direct = raw_read_direct(rawp, bs, n)
        res.update(raw_read_cold_GBps=gbps(nbytes, r_raw_cold), read_cold_ratio=r_raw_cold / r_tier_cold)
        if r_direct is not None:
            res.update(raw_read_odirect_GBps=gbps(nbytes, r_direct), read_cold_ratio_vs_odirect=r_direct / r_tier_cold)
    return res


DECODE_LAYERS, DECODE_GETS_PER_LAYER = 32, 8  # the decode-shaped step: an 8B model's 32 layers


def bench_compaction(root: str, rec_bytes: int, total_bytes: int, steps: int, rounds: int, versions: dict) -> dict:
    """Latency of steps on L3 while background compaction empties segments 3/4 dead, and on
    the same tier without compaction, alternated, for each DiskTier class in ``versions``
    (this tree's as ``new``, and another as ``base`` where the caller passes one), two step shapes:

      decode  a sparse decode step of an 8B model (32 layers): per layer ``DECODE_GETS_PER_LAYER``
              budget blocks read from L3 in one ``get_many`` (as the store's swap-in reads them),
              then the step's new blocks, one per layer, written in one ``put_many``
      micro   one put and three gets: tens of microseconds, where one scheduling hiccup of the
              OS is already several times the step (its p99/p50 is high without compaction too)

    Each round and version fills a tier (``total_bytes`` of ``rec_bytes`` records), deletes 3 in
    4 of them, runs steps with compaction off (threshold 0), then turns it on and runs steps
    until it has emptied every candidate (at least ``steps``); the order of the two alternates
    by round. Also the compactor's share of the time while it ran (bounded by ``compact_share``)
    and its longest step. The target (p99 <= 2x p50 while compaction runs) is judged on the
    decode step of this tree."""
    import random

    rng = random.Random(0)
    n = max(64, total_bytes // rec_bytes)
    seg_bytes = max(1 << 20, min(4 << 20, total_bytes // 8))  # at least a few sealed segments
    vals = [os.urandom(rec_bytes) for _ in range(64)]
    dead = [f"r{j}" for j in range(n) if j % 4]
    live = [f"r{j}" for j in range(0, n, 4)]
    path = os.path.join(root, "compact")
    counter = iter(range(1 << 62))

    def decode_step(t) -> None:
        get_many = t.get_many
        for _ in range(DECODE_LAYERS):
            assert all(v is not None for v in get_many(rng.sample(live, DECODE_GETS_PER_LAYER)))
        i = next(counter)
        assert all(t.put_many([(f"new{i}/{layer}", vals[(i + layer) % 64]) for layer in range(DECODE_LAYERS)]))

    def micro_step(t) -> None:
        i = next(counter)
        t.put(f"new{i}", vals[i % 64])
        for k in rng.sample(live, 3):
            assert t.get(k) is not None

    sched = _RunQueueClock()

    def steps_on(t, step, compacting: bool, count: int, adjusted: list | None,
                 parts: list | None = None) -> list[float]:
        """Step latencies: ``count`` steps, or with compaction on until it has nothing left to
        do (at least ``count``, at most 10x). ``adjusted`` gets each one less the time this
        thread sat in the run queue meanwhile (the other processes' load), where measurable;
        ``parts`` each one's breakdown (see _StepProbe)."""
        if compacting:
            t.compact_threshold = 0.5
            _L3(t).worker.wake()
        lat = []
        for i in range(10 * count if compacting else count):
            q0 = sched.waited() if adjusted is not None else 0.0
            probe.begin()
            c0, s0 = time.thread_time(), time.perf_counter()
            step(t)
            dt = time.perf_counter() - s0
            cpu = time.thread_time() - c0
            lat.append(dt)
            queued = sched.waited() - q0 if adjusted is not None else 0.0
            if adjusted is not None:
                adjusted.append(dt - queued)
            if parts is not None:
                parts.append(probe.end(dt, cpu, queued))
            else:
                probe.end(dt, cpu, queued)
            if compacting and i + 1 >= count and _L3(t).job is None and not _L3(t).candidates():
                break
        if compacting:
            while _L3(t).job is not None or _L3(t).candidates():  # the rest, so the next round starts alike
                time.sleep(0.01)
        return lat

    lat = {(v, w, c): [] for v in versions for w in ("decode", "micro") for c in ("with", "without")}
    adj = {(v, c): [] for v in versions for c in ("with", "without")}  # decode steps, run-queue waits removed
    parts = {(v, c): [] for v in versions for c in ("with", "without")}  # decode steps' breakdowns
    holds = {v: {"tier_lock": [], "write_lock": []} for v in versions}  # the compactor's, with compaction on
    probe = _StepProbe()
    comp = {v: dict(busy=0.0, window=0.0, max_step=0.0, compactions=0, share=0.0) for v in versions}
    for r in range(rounds):
        for v, cls in versions.items():
            for w, step in (("decode", decode_step), ("micro", micro_step)):
                shutil.rmtree(path, ignore_errors=True)
                t = cls(path, capacity_bytes=8 * total_bytes + (64 << 20), segment_bytes=seg_bytes,
                        durability="never", compact_threshold=0.0)
                probe.install(t, holds[v])
                probe.version = v
                for i in range(0, n, 64):
                    t.put_many([(f"r{j}", vals[j % 64]) for j in range(i, min(n, i + 64))])
                t.delete_many(dead)
                least = steps if w == "micro" else max(20, steps // 50)
                count = 10 * least  # steps without compaction when they go first: as many as it may take
                for c in (("without", "with") if r % 2 == 0 else ("with", "without")):
                    s0 = t.stats()
                    t0 = time.perf_counter()
                    probe.holding = c == "with"
                    w0 = _thread_schedstat(_L3(t).worker._thread)
                    got = steps_on(t, step, c == "with", least if c == "with" else count,
                                   adj[v, c] if w == "decode" and sched.available else None,
                                   parts[v, c] if w == "decode" else None)
                    probe.holding = False
                    if c == "with" and w0 is not None and (w1 := _thread_schedstat(_L3(t).worker._thread)):
                        comp[v]["cpu"] = comp[v].get("cpu", 0.0) + w1[0] - w0[0]
                        comp[v]["queued"] = comp[v].get("queued", 0.0) + w1[1] - w0[1]
                    if c == "with":
                        s1, cs = t.stats(), comp[v]
                        cs["window"] += time.perf_counter() - t0
                        cs["busy"] += s1["compact_busy_seconds"] - s0["compact_busy_seconds"]
                        cs["compactions"] += s1["compactions"] - s0["compactions"]
                        cs["max_step"] = max(cs["max_step"], s1["compact_max_step_seconds"])
                        cs["share"] = _L3(t).share
                        count = len(got)  # as many steps without compaction
                    else:
                        t.compact_threshold = 0.0
                    lat[v, w, c] += got
                t.close()
    probe.close()
    shutil.rmtree(path, ignore_errors=True)
    res: dict = {"records": n, "record_bytes": rec_bytes, "rounds": rounds,
                 "switch_interval_ms": sys.getswitchinterval() * 1e3,
                 "decode_step": f"{DECODE_LAYERS} layers x get_many of {DECODE_GETS_PER_LAYER} + one put_many of "
                                f"{DECODE_LAYERS} records"}
    for v in versions:
        for w in ("decode", "micro"):
            d = res[f"{v}_{w}"] = {"steps_with": len(lat[v, w, "with"])}
            for c in ("with", "without"):
                for q in (50, 99):
                    d[f"p{q}_us_{c}"] = percentile(lat[v, w, c], q / 100) * 1e6
            d.update(p99_over_p50_with=d["p99_us_with"] / d["p50_us_with"],
                     p99_over_p50_without=d["p99_us_without"] / d["p50_us_without"],
                     p50_ratio_with_vs_without=d["p50_us_with"] / d["p50_us_without"],
                     p99_ratio_with_vs_without=d["p99_us_with"] / d["p99_us_without"])
        if adj[v, "with"]:
            d = res[f"{v}_decode_runqueue_removed"] = {}
            for c in ("with", "without"):
                for q in (50, 99):
                    d[f"p{q}_us_{c}"] = percentile(adj[v, c], q / 100) * 1e6
            d.update(p99_over_p50_with=d["p99_us_with"] / d["p50_us_with"],
                     p99_over_p50_without=d["p99_us_without"] / d["p50_us_without"])
        cs = comp[v]
        res[f"{v}_compactor"] = {"compactions": cs["compactions"], "time_share": cs["busy"] / max(cs["window"], 1e-9),
                                 "compact_share": cs["share"], "max_step_ms": cs["max_step"] * 1e3,
                                 "thread_cpu_s": cs.get("cpu", 0.0), "thread_run_queue_s": cs.get("queued", 0.0)}
        for name, hs in holds[v].items():
            res[f"{v}_compactor"].update({f"{name}_holds": len(hs),
                                          f"{name}_hold_p99_us": percentile(hs, 0.99) * 1e6 if hs else 0.0,
                                          f"{name}_hold_max_us": max(hs, default=0.0) * 1e6})
        cg = probe.other_gc.get(v, [])
        res[f"{v}_compactor"].update(gc_collections=len(cg), gc_full_collections=sum(g == 2 for g, _ in cg),
                                     gc_max_ms=max((s for _, s in cg), default=0.0) * 1e3)
        for c in ("with", "without"):
            res[f"{v}_decode_where_{c}"] = _breakdown(parts[v, c])
    # the verdict, on the decode step of this tree: as measured where the machine's own steps
    # meet the target without compaction; else with the run-queue waits (other processes' load)
    # taken out, where those steps meet it so; else relative to the steps without compaction
    d, r = res["new_decode"], res.get("new_decode_runqueue_removed")
    if d["p99_over_p50_without"] <= 2.0:
        res["judged"], res["target_met"] = "absolute", d["p99_over_p50_with"] <= 2.0
    elif r is not None and r["p99_over_p50_without"] <= 2.0:
        res["judged"], res["target_met"] = "runqueue_removed", r["p99_over_p50_with"] <= 2.0
    else:
        res["judged"], res["target_met"] = "vs_without_compaction", d["p99_ratio_with_vs_without"] <= 2.0
    return res



class _L3:
    """The internals of a DiskTier this bench reaches into, for this tree's (composed parts,
    kvtier/tiers/disk/) and an older revision's (one class with ``_``-attributes) alike."""

    def __init__(self, t) -> None:
        self.t = t
        self.parts = getattr(t, "_compaction", None)  # None: an older revision's tier

    @property
    def job(self):
        return self.parts.job if self.parts is not None else self.t._job

    def candidates(self) -> list:
        return self.parts.candidates() if self.parts is not None else self.t._candidates()

    @property
    def worker(self):
        return self.parts.worker if self.parts is not None else self.t._worker

    @property
    def share(self) -> float:
        return self.parts.share if self.parts is not None else self.t._share

    @property
    def tier_lock(self):
        return self.t._locks.tier if self.parts is not None else self.t._lock

    @tier_lock.setter
    def tier_lock(self, lock) -> None:
        if self.parts is not None:
            self.t._locks.tier = lock
        else:
            self.t._lock = lock

    @property
    def write_lock(self):
        return self.t._locks.write if self.parts is not None else self.t._write_lock

    @write_lock.setter
    def write_lock(self, lock) -> None:
        if self.parts is not None:
            self.t._locks.write = lock
        else:
            self.t._write_lock = lock

class _StepProbe:
    """Where a step's time goes: it swaps a tier's two locks for timed ones and counts the
    cyclic GC's collections, so that each step (between ``begin`` and ``end``, on the thread
    that runs the steps) is split into its CPU time (GC pauses within it), its run-queue wait
    (other processes' load) and the time it slept: waiting for a lock the compactor (the only
    other thread) held, for the GIL, or for I/O. The time spent inside lock acquisitions
    (sleeping, queued again once woken, taking the GIL back) is reported beside them. While
    ``holding``, other threads' outermost lock holds are recorded (the compactor's)."""

    def __init__(self) -> None:
        self.step_thread = threading.get_ident()
        self.active = self.holding = False
        self.wait = {"tier_lock": 0.0, "write_lock": 0.0}
        self.gc_s, self.gc_n, self._gc0 = 0.0, 0, 0.0
        self.version = ""
        self.other_gc: dict[str, list] = {}  # version -> (generation, seconds) of collections in the compactor
        gc.callbacks.append(self._gc)

    def install(self, t, holds: dict) -> None:
        l3 = _L3(t)
        l3.tier_lock = _TimedLock(l3.tier_lock, self, "tier_lock", holds["tier_lock"])
        l3.write_lock = _TimedLock(l3.write_lock, self, "write_lock", holds["write_lock"])

    def _gc(self, phase: str, info: dict) -> None:
        mine = threading.get_ident() == self.step_thread
        if phase == "start":
            self._gc0 = time.perf_counter()  # (collections hold the GIL: never two at once)
        elif mine and self.active:
            self.gc_s += time.perf_counter() - self._gc0
            self.gc_n += 1
        elif not mine and self.holding:  # in the compactor: the stepping thread waits for the GIL
            self.other_gc.setdefault(self.version, []).append((info["generation"], time.perf_counter() - self._gc0))

    def begin(self) -> None:
        self.wait = {"tier_lock": 0.0, "write_lock": 0.0}
        self.gc_s, self.gc_n, self.active = 0.0, 0, True
        self._ru0 = resource.getrusage(resource.RUSAGE_THREAD)

    def end(self, wall: float, cpu: float, queued: float) -> dict:
        self.active = False
        ru = resource.getrusage(resource.RUSAGE_THREAD)
        # the kernel's share of the step's CPU and its page faults: a step that touches pages
        # the compactor just wrote (through the mapping) pays for mapping them in. The user/
        # kernel split is sampled at the scheduler's tick, so it is read as a mean over steps
        return {"wall": wall, "cpu": cpu, "sys": ru.ru_stime - self._ru0.ru_stime, "run_queue": queued,
                "slept": max(0.0, wall - cpu - queued),
                "tier_lock_wait": self.wait["tier_lock"], "write_lock_wait": self.wait["write_lock"],
                "gc": self.gc_s, "gc_collections": self.gc_n, "minor_faults": ru.ru_minflt - self._ru0.ru_minflt}

    def close(self) -> None:
        gc.callbacks.remove(self._gc)


class _TimedLock:
    """A tier lock (RLock) that adds each wait of the stepping thread to ``probe.wait[name]``
    and, while ``probe.holding``, each outermost hold by another thread to ``holds``."""

    def __init__(self, lock, probe: _StepProbe, name: str, holds: list) -> None:
        self._inner, self._probe, self._name, self._holds = lock, probe, name, holds
        self._depth: dict[int, int] = {}  # thread -> recursion depth (each thread writes its own)
        self._since: dict[int, float] = {}

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        t0 = time.perf_counter()
        ok = self._inner.acquire(blocking, timeout)
        if ok:
            tid = threading.get_ident()
            d = self._depth.get(tid, 0)
            self._depth[tid] = d + 1
            if d == 0:
                now = time.perf_counter()
                if tid == self._probe.step_thread:
                    if self._probe.active:
                        self._probe.wait[self._name] += now - t0
                else:
                    self._since[tid] = now
        return ok

    def release(self) -> None:
        tid = threading.get_ident()
        d = self._depth[tid] = self._depth[tid] - 1
        if d == 0 and tid != self._probe.step_thread:
            since = self._since.pop(tid)
            if self._probe.holding:
                self._holds.append(time.perf_counter() - since)
        self._inner.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()

    def _is_owned(self) -> bool:
        return self._inner._is_owned()


_COUNTS = ("gc_collections", "minor_faults")  # step parts that are counts, not seconds


def _breakdown(parts: list[dict]) -> dict:
    """Mean microseconds of each part over the middle half of the steps (by wall time) and
    over those from p98 to p99.5 (what sets p99, without the few worst that would dominate a mean)."""
    if not parts:
        return {}
    by = sorted(parts, key=lambda p: p["wall"])
    n = len(by)
    out = {}
    for name, sub in (("mid", by[n // 4:max(n // 4 + 1, 3 * n // 4)]),
                      ("p99", by[min(n - 1, int(0.98 * n)):max(min(n, int(0.98 * n) + 1), int(0.995 * n))])):
        out[name] = {k: (sum(p[k] for p in sub) / len(sub)) * (1 if k in _COUNTS else 1e6)
                     for k in sub[0]}
        out[name]["steps"] = len(sub)
    return out


def _thread_schedstat(thread: threading.Thread) -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable but waiting for one) of a thread of this process."""
    try:
        with open(f"/proc/self/task/{thread.native_id}/schedstat") as f:
            on, queued, _ = f.read().split()
        return int(on) / 1e9, int(queued) / 1e9
    except (OSError, ValueError, TypeError):
        return None


class _RunQueueClock:
    """Seconds the calling thread has spent runnable but waiting for a CPU (Linux schedstat),
    read through one fd kept open on the thread's own file."""

    def __init__(self) -> None:
        try:
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            self.available = True
        except OSError:
            self._fd, self.available = -1, False

    def waited(self) -> float:
        return int(os.pread(self._fd, 64, 0).split()[1]) / 1e9

    def __del__(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)


def percentile(lat: list[float], q: float) -> float:
    lat = sorted(lat)
    return lat[min(len(lat) - 1, int(q * len(lat)))]


SECTIONS = ("L1", "L2", "L3", "compaction", "reopen", "crc", "L4")


@dataclass
class Base:
    """Another DiskTier measured beside this tree's in the same run (research/bench_tiers_base.py
    brings older revisions'): ``tiers``, a module with a ``DiskTier``, for the L3 reads and the
    compaction steps; ``reopen_dir``, a folder holding a ``kvtier_tiers_base`` package, for the
    reopen; each None where there is none, ``label``/``reopen_label`` name them in the output."""
    label: str
    tiers: object | None
    reopen_label: str
    reopen_dir: str | None


_REOPEN_CHILD = r"""
import json, os, sys, time
which, path, pkgdir, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if which == "base":
    sys.path.insert(0, pkgdir)
    import kvtier_tiers_base as tiers
else:
    from kvtier import tiers
def reopen_key(j):
    return f"m{j:032x}/0/{j:032x}"[:40]
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
r0 = rss()
t0, c0 = time.perf_counter(), time.thread_time()
t = tiers.DiskTier(path, capacity_bytes=8 << 30, durability="never")
dt, dc = time.perf_counter() - t0, time.thread_time() - c0
r1 = rss()
keys = [reopen_key(j) for j in range(0, n, max(1, n // 10_000))]
t1, c1 = time.perf_counter(), time.thread_time()
assert all(t.get(k) is not None for k in keys)
first, first_cpu = (time.perf_counter() - t1) / len(keys), (time.thread_time() - c1) / len(keys)
print(json.dumps({"seconds": dt, "cpu_seconds": dc, "records": len(t), "rss_delta_bytes": r1 - r0,
                  "first_get_s": first, "first_get_cpu_s": first_cpu,
                  "checkpoint_loaded": t.stats()["checkpoint_loaded"]}), flush=True)
os._exit(0)  # no close: the INDEX stays the one written for these runs
"""


def reopen_key(j: int) -> str:
    return f"m{j:032x}/0/{j:032x}"[:40]  # a store key's length and shape


def bench_crc(repeat: int, smoke: bool) -> dict:
    """GB/s of the record CRC (kvtier._crc) beside zlib's and the CRC32C packages' when
    installed, and of a bytes copy of the same buffer (what a read costs anyway), at one
    small and one large record size: the CRC is worth changing only if another is faster."""
    import importlib
    import zlib

    from kvtier import _crc

    impls = {f"kvtier_{_crc.IMPLEMENTATION}": _crc.crc32, "zlib": zlib.crc32}
    for mod, fn in (("crc32c", "crc32c"), ("google_crc32c", "value")):
        try:
            impls[mod] = getattr(importlib.import_module(mod), fn)
        except ImportError:
            pass
    res: dict = {}
    for size in (4 << 10, 256 << 10):
        buf = os.urandom(size)
        reps = max(1, (8 << 20 if smoke else 256 << 20) // size)

        def loop(f):
            def run() -> None:
                for _ in range(reps):
                    f(buf)  # (each result dropped at once, as a read's check does)
            return run

        fns = {name: loop(f) for name, f in impls.items()}
        fns["bytes_copy"] = loop(lambda b: b[1:])
        t = best_of(fns, repeat)
        res[f"{size >> 10}KiB_GBps"] = {name: gbps(size * reps, sec) for name, sec in t.items()}
    return res


def bench_reopen(root: str, n: int, repeat: int, in_process: bool, pkgdir: str | None = None,
                 base_label: str | None = None) -> dict:
    """Reopening a directory of ``n`` small records from its checkpoint: this tree, and where
    ``pkgdir`` holds a ``kvtier_tiers_base`` package (``base_label`` names it) that DiskTier too,
    alternated, each with its own INDEX over the same (hard-linked) segment files; seconds,
    microseconds a record, RSS growth and the first get of 10k keys after it. Each open runs in
    a fresh interpreter (RSS is its own), except in --smoke."""
    new_dir, base_dir = os.path.join(root, "reopen-new"), os.path.join(root, "reopen-base")
    t = DiskTier(new_dir, capacity_bytes=8 << 30, durability="never")
    v = os.urandom(40)
    for i in range(0, n, 20_000):
        t.put_many([(reopen_key(j), v) for j in range(i, min(n, i + 20_000))])
    hold = checkpoint_hold(t, [reopen_key(j) for j in range(0, n, max(1, n // 1000))])
    t.close()  # writes this tree's INDEX
    order = ["new"]
    if pkgdir is not None:
        os.makedirs(base_dir)
        for name in os.listdir(new_dir):
            if name.startswith("seg-"):
                os.link(os.path.join(new_dir, name), os.path.join(base_dir, name))
        sys.path.insert(0, pkgdir)
        try:
            import kvtier_tiers_base
            kvtier_tiers_base.DiskTier(base_dir, capacity_bytes=8 << 30, durability="never").close()  # its INDEX
        finally:
            sys.path.remove(pkgdir)
        order = ["base", "new"]
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    runs: dict = {w: [] for w in order}
    for _ in range(repeat):
        for which in order:
            path = new_dir if which == "new" else base_dir
            if in_process:
                out = _reopen_in_process(which, path, n)
            else:
                r = subprocess.run([sys.executable, "-c", _REOPEN_CHILD, which, path, pkgdir or "", str(n)],
                                   capture_output=True, text=True, env=env)
                if r.returncode != 0:
                    raise RuntimeError(f"reopen child ({which}) failed: {r.stderr[-2000:]}")
                out = json.loads(r.stdout.strip().splitlines()[-1])
            assert out["records"] == n and out["checkpoint_loaded"] == 1, out
            runs[which].append(out)
    res: dict = {"records": n, "base_commit": base_label if pkgdir else None, "fresh_process": not in_process,
                 "checkpoint": hold}
    for which, outs in runs.items():
        best = min(outs, key=lambda o: o["seconds"])
        res[which] = {"seconds": best["seconds"], "us_per_record": best["seconds"] / n * 1e6,
                      "cpu_us_per_record": min(o["cpu_seconds"] for o in outs) / n * 1e6,
                      "rss_delta_MiB": best["rss_delta_bytes"] / 2**20,
                      "rss_bytes_per_record": best["rss_delta_bytes"] / n,
                      "first_get_us": min(o["first_get_s"] for o in outs) * 1e6,
                      "first_get_cpu_us": min(o["first_get_cpu_s"] for o in outs) * 1e6}
    if "base" in res:
        res["speedup_vs_base"] = res["base"]["seconds"] / res["new"]["seconds"]
        res["cpu_speedup_vs_base"] = res["base"]["cpu_us_per_record"] / res["new"]["cpu_us_per_record"]
        res["rss_ratio_vs_base"] = res["new"]["rss_delta_MiB"] / max(1e-9, res["base"]["rss_delta_MiB"])
    shutil.rmtree(new_dir, ignore_errors=True)
    shutil.rmtree(base_dir, ignore_errors=True)
    return res


class _HoldTimer:
    """A tier lock stand-in that records how long one thread holds it at a time (outermost
    acquire to last release: the lock is reentrant)."""

    def __init__(self, lock, thread: int) -> None:
        self.lock, self.thread, self.depth, self.t0, self.holds = lock, thread, 0, 0.0, []

    def acquire(self, *args) -> bool:
        got = self.lock.acquire(*args)
        if got and threading.get_ident() == self.thread:
            self.depth += 1
            if self.depth == 1:
                self.t0 = time.perf_counter()
        return got

    def release(self) -> None:
        if threading.get_ident() == self.thread:
            self.depth -= 1
            if self.depth == 0:
                self.holds.append(time.perf_counter() - self.t0)
        self.lock.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


def checkpoint_hold(t: DiskTier, keys: list[str]) -> dict:
    """One ``checkpoint()`` of ``t`` (every record written since it opened: its index all in
    the dict, the costliest case) while a reader thread gets ``keys`` round and round: the
    checkpoint's seconds, the longest it held the tier lock in one go (what it blocks a get
    or put for), and the reader's p50 and longest get meanwhile (the GIL included), beside
    the reader's longest get over as long a time without a checkpoint (the machine's own)."""
    l3 = _L3(t)
    lock, timer = l3.tier_lock, _HoldTimer(l3.tier_lock, threading.get_ident())

    def reading(work) -> tuple[float, list[float]]:
        lat: list[float] = []
        stop = threading.Event()

        def reader() -> None:
            i = 0
            while not stop.is_set():
                t0 = time.perf_counter()
                assert t.get(keys[i % len(keys)]) is not None
                lat.append(time.perf_counter() - t0)
                i += 1

        th = threading.Thread(target=reader, daemon=True)
        th.start()
        try:
            time.sleep(0.05)
            t0 = time.perf_counter()
            work()
            return time.perf_counter() - t0, sorted(lat)
        finally:
            stop.set()
            th.join()

    l3.tier_lock = timer
    try:
        dt, lat = reading(t.checkpoint)
    finally:
        l3.tier_lock = lock
    _, idle = reading(lambda: time.sleep(dt))
    return {"records": len(t), "seconds": dt, "max_lock_hold_ms": max(timer.holds) * 1e3,
            "lock_holds": len(timer.holds), "reader_get_p50_us": lat[len(lat) // 2] * 1e6,
            "reader_get_max_ms": lat[-1] * 1e3, "reader_get_max_ms_without": idle[-1] * 1e3}


def _reopen_in_process(which: str, path: str, n: int) -> dict:
    if which == "base":
        import kvtier_tiers_base as tiers  # noqa: F401 (imported by bench_reopen)
    else:
        from kvtier import tiers
    r0 = rss_bytes()
    t0, c0 = time.perf_counter(), time.thread_time()
    t = tiers.DiskTier(path, capacity_bytes=8 << 30, durability="never")
    dt, dc = time.perf_counter() - t0, time.thread_time() - c0
    r1 = rss_bytes()
    keys = [reopen_key(j) for j in range(0, n, max(1, n // 10_000))]
    t1, c1 = time.perf_counter(), time.thread_time()
    assert all(t.get(k) is not None for k in keys)
    first, first_cpu = (time.perf_counter() - t1) / len(keys), (time.thread_time() - c1) / len(keys)
    out = {"seconds": dt, "cpu_seconds": dc, "records": len(t), "rss_delta_bytes": r1 - r0,
           "first_get_s": first, "first_get_cpu_s": first_cpu, "checkpoint_loaded": t.stats()["checkpoint_loaded"]}
    t.close()
    return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _l4_servers(root: str, pool_bytes: int) -> tuple[dict, list]:
    """Factories of the L3 and L4 tiers to compare (each a fresh namespace), and what to stop after."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.mooncake_server import mooncake_unavailable, start_mooncake_pool
    from tests.redis_server import REDIS_SERVER, start_redis_server

    made: dict = {"L3": lambda tag: DiskTier(os.path.join(root, f"l4-l3-{tag}"), capacity_bytes=4 * pool_bytes,
                                             durability="batch")}
    stop: list = []
    if REDIS_SERVER is not None:
        from kvtier.tiers import RemoteTier

        redis = start_redis_server(os.path.join(root, "redis"))
        stop.append(redis.kill)
        made["redis"] = lambda tag: RemoteTier(redis.url, key_prefix=f"bench-{tag}:", socket_timeout_s=10.0)
    else:
        print("L4: redis-server is not installed: Redis left out", file=sys.stderr)
    why = mooncake_unavailable()
    if why is None:
        from kvtier.tiers import MooncakeTier

        pool = start_mooncake_pool(os.path.join(root, "mooncake"), segment_bytes=pool_bytes)
        stop.append(pool.kill)
        made["mooncake"] = lambda tag: MooncakeTier(pool.url_with(buffer_bytes=64 << 20), key_prefix=f"bench-{tag}:")
    else:
        print(f"L4: Mooncake left out: {why}", file=sys.stderr)
    return made, stop


def bench_l4(root: str, sizes: list[int], total_bytes: int, batch: int, repeat: int, lat_ops: int) -> dict:
    """Remote tiers beside L3 (see the module docstring): GB/s of batched puts and gets, p50/p99 of
    single ones, for each record size; tiers interleaved round by round (same machine load)."""
    made, stop = _l4_servers(root, pool_bytes=max(64 << 20, 3 * total_bytes))
    out: dict = {}
    try:
        for size in sizes:
            n = max(2 * batch, total_bytes // size)
            g = torch.Generator().manual_seed(size)
            recs = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).numpy().tobytes() for _ in range(n)]
            keys = [f"r{i}" for i in range(n)]
            tiers = {name: make(f"{size}") for name, make in made.items()}
            put_s = dict.fromkeys(tiers, float("inf"))
            get_s = dict(put_s)
            lat: dict = {name: {"put": [], "get": []} for name in tiers}
            for _ in range(repeat):
                for name, t in tiers.items():
                    t0 = time.perf_counter()
                    for i in range(0, n, batch):
                        assert all(t.put_many(list(zip(keys[i:i + batch], recs[i:i + batch])))), name
                    t.sync()
                    put_s[name] = min(put_s[name], time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    for i in range(0, n, batch):
                        got = t.get_many(keys[i:i + batch])
                        assert all(g is not None and len(g) == size for g in got), name
                    get_s[name] = min(get_s[name], time.perf_counter() - t0)
                    for i in range(min(lat_ops, n)):
                        t0 = time.perf_counter()
                        t.put(keys[i], recs[i])
                        t1 = time.perf_counter()
                        t.get(keys[i])
                        lat[name]["put"].append(t1 - t0)
                        lat[name]["get"].append(time.perf_counter() - t1)
            for t in tiers.values():
                t.close()
            d: dict = {}
            for name in tiers:
                d[f"{name}_put_GBps"] = gbps(n * size, put_s[name])
                d[f"{name}_get_GBps"] = gbps(n * size, get_s[name])
                for op in ("put", "get"):
                    us = torch.tensor(lat[name][op], dtype=torch.float64) * 1e6
                    d[f"{name}_{op}_p50_us"] = float(us.quantile(0.5))
                    d[f"{name}_{op}_p99_us"] = float(us.quantile(0.99))
            if "mooncake" in tiers:
                for other in ("redis", "L3"):
                    if other not in tiers:
                        continue
                    for op in ("put", "get"):
                        d[f"mooncake_vs_{other}_{op}_GBps"] = d[f"mooncake_{op}_GBps"] / d[f"{other}_{op}_GBps"]
                        d[f"mooncake_vs_{other}_{op}_p50"] = d[f"mooncake_{op}_p50_us"] / d[f"{other}_{op}_p50_us"]
            out[f"L4_{size >> 10}KiB"] = d
    finally:
        for fn in stop:
            fn()
    return out


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    if isinstance(v, dict):
        return "{" + " ".join(f"{k}={fmt(x)}" for k, x in v.items()) + "}"
    return str(v)


def main(argv: list[str] | None = None, base: Callable[[str], Base] | None = None) -> int:
    """The run; ``base(root)`` gives another DiskTier to measure beside this tree's (its files
    under ``root``, the run's temporary folder)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds (CI)")
    ap.add_argument("--block-kib", type=int, default=256, help="record size in KiB")
    ap.add_argument("--small-kib", type=int, default=4,
                    help="record size in KiB of the small-record L3 run (one layer's int4 block is 2-8 KiB)")
    ap.add_argument("--total-mib", type=int, default=256, help="bytes moved per measurement in MiB")
    ap.add_argument("--batch", type=int, default=16, help="records per put_many/get_many (one sync each)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads for the copy_ references (the tiers copy host bytes on one "
                         "thread; on a loaded machine threaded copies also stall); 0 = torch's default")
    ap.add_argument("--only", choices=SECTIONS, action="append", help="run only these sections (repeatable)")
    ap.add_argument("--reopen-records", type=int, default=1_000_000, help="records in the reopened directory")
    ap.add_argument("--reopen-repeat", type=int, default=3, help="reopens of each version (alternated)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.block_kib, a.total_mib, a.repeat, a.reopen_records = 64, 8, 2, 20_000
    if min(a.block_kib, a.small_kib, a.total_mib, a.batch, a.repeat, a.reopen_records, a.reopen_repeat) < 1:
        raise SystemExit("--block-kib, --small-kib, --total-mib, --batch, --repeat, --reopen-records and "
                         "--reopen-repeat must be >= 1")
    if a.torch_threads > 0:
        torch.set_num_threads(a.torch_threads)
    bs = a.block_kib << 10
    n = max(2, (a.total_mib << 20) // bs)
    g = torch.Generator().manual_seed(0)
    # raw records: int8-quantized-like bytes (incompressible); lz4 records: fp16 KV-like values
    raw_blocks = [torch.randint(0, 256, (bs,), dtype=torch.uint8, generator=g).numpy().tobytes() for _ in range(n)]
    kv_blocks = [torch.randn(bs // 2, generator=g).half().numpy().tobytes() for _ in range(n)]
    l1_blocks = [torch.randn(bs // 2, generator=g).half() for _ in range(n)]

    todo = set(a.only or SECTIONS)
    out: dict = {"block_bytes": bs, "blocks": n, "batch": a.batch, "torch_threads": torch.get_num_threads()}
    if "L1" in todo:
        out["L1_cpu"] = bench_l1(l1_blocks, "cpu", a.repeat)
        if torch.cuda.is_available():
            out["L1_cuda"] = bench_l1(l1_blocks, "cuda", a.repeat)
    if "L2" in todo:
        out["L2"] = bench_l2(raw_blocks, a.repeat)
    if "crc" in todo:
        out["crc"] = bench_crc(a.repeat, a.smoke)
    root = tempfile.mkdtemp(prefix="kvtier-bench-", dir=a.dir)
    other = base(root) if base is not None and todo & {"L3", "compaction", "reopen"} else None
    label = other.label if other is not None else None
    try:
        if "L3" in todo:
            bt = other.tiers if other is not None else None
            out["L3_raw"] = bench_l3(root, raw_blocks, a.batch, False, a.repeat, bt)
            out["L3_lz4"] = bench_l3(root, kv_blocks, a.batch, True, a.repeat)
            sb = a.small_kib << 10
            small = [torch.randint(0, 256, (sb,), dtype=torch.uint8, generator=g).numpy().tobytes()
                     for _ in range(max(2, min(4096, (a.total_mib << 20) // sb)))]
            out["L3_small"] = bench_l3(root, small, a.batch, False, a.repeat, bt)
        if "compaction" in todo:
            versions = {"new": DiskTier}
            if other is not None and other.tiers is not None:
                versions["base"] = other.tiers.DiskTier
            out["L3_compaction"] = bench_compaction(root, (a.small_kib << 10) * 2, (4 if a.smoke else 64) << 20,
                                                    300 if a.smoke else 2000, 1 if a.smoke else min(a.repeat, 3),
                                                    versions)
        if "L4" in todo:
            out.update(bench_l4(root, [4 << 10, bs], (1 if a.smoke else min(a.total_mib, 64)) << 20, a.batch,
                                1 if a.smoke else min(a.repeat, 3), 20 if a.smoke else 300))
        if "reopen" in todo:
            out["L3_reopen"] = bench_reopen(root, a.reopen_records, 1 if a.smoke else a.reopen_repeat,
                                            in_process=a.smoke, pkgdir=other and other.reopen_dir,
                                            base_label=other and other.reopen_label)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    tg = out["targets"] = {}
    if "L2" in out:
        l2 = min(out["L2"]["put_tensor_ratio"], out["L2"]["put_bytes_ratio"], out["L2"]["get_into_ratio"])
        tg["L2>=0.5x_copy"] = "PASS" if l2 >= 0.5 else "MISS"
    if "L3_raw" in out:
        l3, small = out["L3_raw"], out["L3_small"]
        tg["L3_write>=0.7x_raw"] = "PASS" if l3["write_ratio"] >= 0.7 else "MISS"
        if "read_cold_ratio" in l3:
            tg["L3_read_cold>=0.7x_raw"] = "PASS" if l3["read_cold_ratio"] >= 0.7 else "MISS"

        def pf(x: float) -> str:
            return "PASS" if x >= 0.7 else "MISS"

        for name, d, kib in (("L3", l3, a.block_kib), ("L3_small", small, a.small_kib)):
            vs = f"{kib} KiB records, wall, vs the same bytes read with f.read per record; reading thread's CPU"
            base = (lambda key: f"; base {label} {d[f'base_{key}']:.2f}" if f"base_{key}" in d else "")
            tg[f"{name}_read_warm>=0.7x_raw"] = (
                f"{pf(d['read_warm_ratio'])} {d['read_warm_ratio']:.2f}x (get_many, batch {a.batch}, {vs} "
                f"{d['read_warm_ratio_cpu']:.2f}x{base('read_warm_ratio')}; vs one preadv a batch "
                f"{d['read_warm_ratio_vs_preadv']:.2f}x)")
            tg[f"{name}_read_warm_with_writer>=0.7x_raw"] = (
                f"{pf(d['read_warm_ratio_with_writer'])} {d['read_warm_ratio_with_writer']:.2f}x (get_many while a "
                f"thread writes, {vs} {d['read_warm_ratio_with_writer_cpu']:.2f}x"
                f"{base('read_warm_ratio_with_writer')})")
            tg[f"{name}_get_warm>=0.7x_raw"] = (
                f"{pf(d['get_warm_ratio'])} {d['get_warm_ratio']:.2f}x (one get() a record, {vs} {d['get_warm_ratio_cpu']:.2f}x{base('get_warm_ratio')}; while a thread writes "
                f"{d['get_warm_ratio_with_writer']:.2f}x{base('get_warm_ratio_with_writer')})")
    if "L3_compaction" in out:
        c = out["L3_compaction"]

        def shape(v: str, w: str) -> str:
            d = c.get(f"{v}_{w}")
            return "n/a" if d is None else (f"p99/p50 {d['p99_over_p50_with']:.2f} with compaction, "
                                            f"{d['p99_over_p50_without']:.2f} without (p50 {d['p50_us_with']:.0f} vs "
                                            f"{d['p50_us_without']:.0f} us)")

        d, r = c["new_decode"], c.get("new_decode_runqueue_removed")
        if c["judged"] == "absolute":
            how = f"p99/p50 with compaction {d['p99_over_p50_with']:.2f}"
        elif c["judged"] == "runqueue_removed":
            how = (f"with the run-queue waits of this loaded machine taken out (its steps' p99 is "
                   f"{d['p99_over_p50_without']:.1f}x p50 without compaction as measured, "
                   f"{r['p99_over_p50_without']:.2f}x so): p99/p50 with compaction {r['p99_over_p50_with']:.2f}")
        else:
            how = (f"vs this machine without compaction, whose decode-step p99 is {d['p99_over_p50_without']:.1f}x "
                   f"p50 already: p99 with/without compaction {d['p99_ratio_with_vs_without']:.2f}x")

        def rq(v: str) -> str:
            x = c.get(f"{v}_decode_runqueue_removed")
            return "" if x is None else (f"; run-queue waits out: {x['p99_over_p50_with']:.2f} with, "
                                         f"{x['p99_over_p50_without']:.2f} without")
        tg["L3_step_p99<=2x_p50_while_compacting"] = (
            ("PASS" if c["target_met"] else "MISS") + f", judged on the decode step ({c['decode_step']}, "
            f"{c['record_bytes'] >> 10} KiB records) {how}. This tree: decode {shape('new', 'decode')}{rq('new')}; "
            f"micro (put + 3 gets) {shape('new', 'micro')}. "
            + (f"Base {label}: decode {shape('base', 'decode')}{rq('base')}; micro {shape('base', 'micro')}. "
               if "base_decode" in c else "")
            + f"Compactor time share {c['new_compactor']['time_share']:.2f} "
            f"(bound {c['new_compactor']['compact_share']:.2f}"
            + (f"; base {c['base_compactor']['time_share']:.2f})" if "base_compactor" in c else ")"))
    if "L3_reopen" in out:
        tg["L3_reopen<1us_per_record"] = "PASS" if out["L3_reopen"]["new"]["us_per_record"] < 1.0 else "MISS"
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"block {bs >> 10} KiB x {n} records, batch {a.batch}{'  (smoke)' if a.smoke else ''}")
    for sect, vals in out.items():
        if isinstance(vals, dict) and sect != "targets":
            print(f"  {sect:8s} " + "  ".join(f"{k}={fmt(v)}" for k, v in vals.items()))
    for name, verdict in tg.items():
        print(f"VERDICT {name}: {verdict}")
    if "L3_compaction" in out:
        for line in compaction_causes(out["L3_compaction"]):
            print(line)
    return 0


def compaction_causes(c: dict) -> list[str]:
    """Lines saying where the decode steps' time went (see _StepProbe), with and without
    compaction, and how long the compactor held each lock."""
    names = (("cpu", "cpu"), ("run_queue", "run-queue"), ("slept", "slept (locks, GIL, I/O)"))
    lines = []
    for v in ("new", "base"):
        for c_ in ("with", "without"):
            d = c.get(f"{v}_decode_where_{c_}")
            if not d:
                continue
            for part in ("mid", "p99"):
                x = d[part]
                lines.append(f"CAUSES {v} decode {c_} compaction, {part:3s} steps ({x.get('steps', 0)}): wall "
                             f"{x['wall']:.0f} us = "
                             + " + ".join(f"{label} {x[k]:.0f}" for k, label in names)
                             + f" (cpu in the kernel {x.get('sys', 0):.0f}, tick-sampled; {x.get('minor_faults', 0):.0f} "
                             f"minor page faults a step); inside lock acquisitions: tier lock {x['tier_lock_wait']:.0f}, write lock "
                             f"{x['write_lock_wait']:.0f}; gc {x['gc']:.0f} us in {x['gc_collections']:.2f} "
                             f"collections a step")
        k = c.get(f"{v}_compactor")
        if k and "tier_lock_hold_max_us" in k:
            lines.append(f"CAUSES {v} compactor holds: tier lock {k['tier_lock_holds']} times, p99 "
                         f"{k['tier_lock_hold_p99_us']:.0f} us, max {k['tier_lock_hold_max_us']:.0f} us; write lock "
                         f"{k['write_lock_holds']} times, p99 {k['write_lock_hold_p99_us']:.0f} us, max "
                         f"{k['write_lock_hold_max_us']:.0f} us (GIL switch interval "
                         f"{c['switch_interval_ms']:.0f} ms); gc in the compactor thread {k['gc_collections']} "
                         f"collections ({k['gc_full_collections']} full), longest {k['gc_max_ms']:.1f} ms; "
                         f"its thread ran {k['thread_cpu_s']:.2f} s and sat runnable in the run queue "
                         f"{k['thread_run_queue_s']:.2f} s")
    return lines


if __name__ == "__main__":
    sys.exit(main())
