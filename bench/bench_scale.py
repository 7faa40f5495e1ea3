"""The store alone (no model) at a real model's KV shape and at long-context serving scale (up to
128k tokens), and how its cost grows.

Workloads, with synthetic KV of the shape (Llama-3-8B by default: 32 layers, 8 KV heads,
head_dim 128, bf16; ``--shape`` for others) and int4 below L1:
  grow      one sequence growing to --max-tokens (128k): prefill in chunks, and at each
            checkpoint (8k, 16k, ... 128k) sparse decode steps (budget 3% of the context:
            select + gather_view + a one-token append per layer, then end_step). The first steps
            after a prefill bring the chosen blocks into L1 while the swap-out worker writes the
            blocks they displace: they run until one swaps nothing in and are reported apart
            ("transient": steps, total ms, swap-ins); the worker is drained, then --steps steady
            steps are timed. research/bench_scale_base.py runs the same workload with the store of
            an older git revision first, in a child process: old and new side by side, same run.
  convs     --convs (8) conversations of --conv-tokens (32k) sharing a --prefix-tokens (4k)
            prefix (content-addressed blocks: one copy per tier), stored once; then decode
            steps with 1, 2, 4, ... of them active at once (round-robin)
  reopen    a DiskTier directory of --reopen-records (1M) small records reopened, in fresh
            processes: from the index checkpoint against a full scan of the same files (and,
            from research/bench_scale_base.py, an older revision's DiskTier beside them)
L1 --l1-gib (2), L2 --l2-gib (8), L3 a real directory (--dir).

Reported (JSON, and PNG curves next to it in --out):
  store time per decode step against context and against conversations, with the fitted
  growth exponent (time ~ x^k); L3 swap-out/in GB/s (time inside DiskTier put/get calls)
  against raw write (fdatasync) and read of a file in the same directory, measured in the same
  run; SSD bytes written per token stored and write amplification (bytes written, compaction,
  tombstones and checkpoints included / record payload); RSS against tokens stored, its
  exponent, and bytes per L3 record; reopen seconds, microseconds per record and RSS.

Default (full) run: about 12 GB of RAM (L1 2 GiB + L2 8 GiB + about 2 GiB for the process: digests,
index, gather copies, decoded blocks kept for the next step) and, with int4 below
L1 (about 36 KiB a token at this shape), 4.6 GiB for the 128k sequence and 8 GiB for the
conversations (the prefix stored once), of which what L2 cannot hold goes to L3: a few GB on disk.
``--codec bf16`` stores 128 KiB a token: 16 + 28 GiB written, about 30 GB on L3 at its peak.
Either stays within 40 GB of disk and 16 GB of RAM. On a shared machine: --l1-gib 1 --l2-gib 4
keeps the process under about 8 GiB (measured: 7.2 GiB growth at 128k with --codec bf16), the
same shapes, more of the KV on L3. --smoke: 4 of the 32 layers, contexts to
4k, 2 conversations of 1k, 20k records reopened; under 30 s, a few hundred MB.

    python bench/bench_scale.py --smoke
    python bench/bench_scale.py --dir /mnt/ssd/kvtier-scale --out results/scale
    python bench/bench_scale.py --max-tokens 32768 --convs 4 --conv-tokens 8192 --l2-gib 2   # reduced
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from kvtier.config import KVTierConfig
from kvtier.store import KVStore

SHAPES = {  # layers, kv_heads, q_heads, head_dim
    "llama3-8b": (32, 8, 32, 128),
    "llama2-70b": (80, 8, 64, 128),
    "smollm2-135m": (30, 3, 9, 64),
}


@dataclass
class Base:
    """An older store measured beside this tree's in the same run (research/bench_scale_base.py
    takes them from git): ``grow(a, root)``, the grow workload's result with that store, run
    before this tree's; ``reopen_src(root)``, the path of a ``disk.py`` whose DiskTier reopens the
    same records first; each gives None where there is none."""
    grow: Callable[[argparse.Namespace, str], dict | None]
    reopen_src: Callable[[str], str | None]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fmt(v) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def fit_exponent(xs, ys) -> float | None:
    """k in y ~ x^k, least squares in log-log (None with fewer than 2 usable points)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(pts) < 2:
        return None
    return float(np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)[0])


class Timed:
    """Wraps an L3 tier's put/get methods to add up the seconds and bytes spent inside them."""

    def __init__(self, tier) -> None:
        self.tier, self.put_s, self.put_b, self.get_s, self.get_b = tier, 0.0, 0, 0.0, 0
        for name in ("put_many", "get", "get_many", "get_into"):
            setattr(tier, name, self._wrap(getattr(tier, name), name.startswith("put")))

    def _wrap(self, fn, is_put):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            dt = time.perf_counter() - t0
            if is_put:
                self.put_s += dt
                self.put_b += sum(memoryview(v).nbytes for _, v in a[0]) if isinstance(a[0], list) else 0
            else:
                self.get_s += dt
                res = out if isinstance(out, list) else [out]
                self.get_b += sum(len(r) if isinstance(r, (bytes, bytearray)) else int(r or 0) for r in res)
            return out
        return timed


def raw_disk(path: str, nbytes: int) -> dict:
    """Sequential write (fdatasync at the end) and cold read of one file in ``path``."""
    p = os.path.join(path, "raw-probe.bin")
    buf = os.urandom(4 << 20)
    t0 = time.perf_counter()
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for _ in range(max(1, nbytes // len(buf))):
        os.write(fd, buf)
    os.fdatasync(fd)
    os.close(fd)
    w = time.perf_counter() - t0
    fd = os.open(p, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    t0 = time.perf_counter()
    while os.read(fd, 4 << 20):
        pass
    r = time.perf_counter() - t0
    t0 = time.perf_counter()
    os.lseek(fd, 0, os.SEEK_SET)
    while os.read(fd, 4 << 20):
        pass
    rw = time.perf_counter() - t0
    os.close(fd)
    size = os.path.getsize(p)
    t0 = time.perf_counter()
    fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
    for _ in range(max(1, nbytes // len(buf))):
        os.write(fd, buf)
    os.close(fd)
    wn = time.perf_counter() - t0
    os.unlink(p)
    return {"raw_write_fdatasync_GBps": size / w / 1e9, "raw_write_GBps": size / wn / 1e9,
            "raw_read_cold_GBps": size / r / 1e9, "raw_read_warm_GBps": size / rw / 1e9}


def make_store(a, shape, dirpath: str, device_tokens: int, budget: int, max_seqs: int) -> KVStore:
    layers, kvh, _, hd = shape
    cfg = KVTierConfig(block_tokens=a.block_tokens, device_tokens=device_tokens, budget_tokens=budget,
                       host_bytes=int(a.l2_gib * (1 << 30)), disk_path=dirpath, disk_bytes=a.disk_gib << 30,
                       codec=a.codec, policy="lru", attention="sparse", max_sequences=max_seqs, write_through=False,
                       prefetch_blocks=a.prefetch_blocks)
    return KVStore(cfg, num_layers=layers, kv_heads=kvh, head_dim=hd, dtype=torch.bfloat16,
                   fingerprint="bench-scale")


class KVSource:
    """Synthetic K/V chunks: a small pool of random tensors reused (generation is not measured)."""

    def __init__(self, shape, chunk: int, seed: int = 0) -> None:
        layers, kvh, qh, hd = shape
        g = torch.Generator().manual_seed(seed)
        self.chunks = [torch.randn(2, kvh, chunk, hd, generator=g).to(torch.bfloat16) for _ in range(4)]
        self.q = torch.randn(qh, 1, hd, generator=g).to(torch.bfloat16)
        self.one = torch.randn(2, kvh, 1, hd, generator=g).to(torch.bfloat16)
        self.chunk = chunk

    def kv(self, i: int, n: int):
        c = self.chunks[i % len(self.chunks)]
        return c[0, :, :n], c[1, :, :n]  # [kv_heads, n, head_dim]


def decode_step(st: KVStore, seqs, layers: int, src: KVSource, budget: int) -> float:
    """One sparse decode step of every sequence in ``seqs``; seconds inside the store."""
    t0 = time.perf_counter()
    for s in seqs:
        for layer in range(layers):
            blocks = st.select(s, layer, src.q, budget_tokens=budget)
            st.gather_view(s, layer, blocks)
            st.append(s, layer, src.one[0], src.one[1])
    st.end_step()
    return time.perf_counter() - t0


def settle(st: KVStore, seqs, layers: int, src: KVSource, budget: int, max_steps: int = 32) -> dict:
    """The first decode steps after a prefill, until one swaps nothing in: they bring the chosen
    blocks into L1 while the swap-out worker writes the prefill's evicted blocks. Then the worker
    is drained, so the measured steps that follow are the steady state (reported apart)."""
    sw0 = st.counters["swap_in_blocks"]
    times = []
    while len(times) < max_steps:
        before = st.counters["swap_in_blocks"]
        times.append(decode_step(st, seqs, layers, src, budget))
        if st.counters["swap_in_blocks"] == before and len(times) > 1:
            break
    st.flush()
    return {"steps": len(times), "first_ms": times[0] * 1e3, "ms": sum(times) * 1e3,
            "swap_in_blocks": st.counters["swap_in_blocks"] - sw0, "times_ms": [x * 1e3 for x in times]}


def p50_as_before(transient_ms: list[float], steady_ms: list[float], steps: int) -> float:
    """The measure of this script's earlier version: the first 2 steps after the prefill skipped,
    the next ``steps`` timed, transient or not (here with the worker drained where it ended)."""
    window = sorted((transient_ms[2:] + steady_ms)[:steps])
    return window[len(window) // 2]


def prefill(st: KVStore, s: int, layers: int, src: KVSource, n: int, offset: int = 0) -> None:
    done = 0
    while done < n:
        take = min(src.chunk, n - done)
        for layer in range(layers):
            k, v = src.kv(offset + done // src.chunk + layer, take)
            st.append(s, layer, k, v)
        st.end_step()
        done += take


def run_grow(a, shape, root: str) -> dict:
    layers = shape[0]
    budget = max(a.block_tokens * 4, int(0.03 * a.max_tokens) // a.block_tokens * a.block_tokens)
    hot = max(budget, (int(a.l1_gib * (1 << 30)) // (2 * shape[1] * shape[3] * 2 * layers)) // a.block_tokens
              * a.block_tokens)
    st = make_store(a, shape, os.path.join(root, "grow"), hot, budget, 1)
    timed = Timed(st.l3)
    src = KVSource(shape, 1024)
    rss0 = rss_bytes()
    s = st.add_sequence()
    points, have = [], 0
    marks = sorted({min(a.max_tokens, m) for m in a.marks})
    t_start = time.perf_counter()
    for m in marks:
        prefill(st, s, layers, src, m - have, offset=have)
        have = m
        bud = max(a.block_tokens * 4, int(0.03 * m) // a.block_tokens * a.block_tokens)
        bud = min(bud, hot)
        st.flush()  # the prefill's swap-outs are not the decode steps' cost
        tr = settle(st, [s], layers, src, bud)
        sw0 = st.counters["swap_in_blocks"]
        steady = [decode_step(st, [s], layers, src, bud) * 1e3 for _ in range(a.steps)]
        times = sorted(x / 1e3 for x in steady)
        swaps = (st.counters["swap_in_blocks"] - sw0) / a.steps
        have += tr["steps"] + a.steps
        st.flush()
        l3 = st.l3.stats()
        # the L2 arena's pages count in RSS once written: what grows beyond them is the rest
        l2_touched = min(st.l2.capacity_bytes, st.l2.stats()["bytes_in"])
        rss_delta = rss_bytes() - rss0
        points.append({"context": have, "step_ms_p50": times[len(times) // 2] * 1e3,
                       "step_ms_p99": times[min(len(times) - 1, int(0.99 * len(times)))] * 1e3,
                       "rss_bytes": rss_bytes(), "rss_delta_bytes": rss_delta, "l2_touched_bytes": l2_touched,
                       "rss_beyond_l2_bytes": rss_delta - l2_touched, "swap_in_blocks_per_step": swaps,
                       "budget_tokens": bud, "top_k": max(0, bud // a.block_tokens - 1 - st.layout.sink_blocks
                                                           - st.layout.window_blocks),
                       "first_step_ms": tr["first_ms"], "transient_steps": tr["steps"],
                       "transient_ms": tr["ms"], "transient_swap_in_blocks": tr["swap_in_blocks"],
                       "step_ms_p50_as_before": p50_as_before(tr["times_ms"], steady, a.steps),
                       "transient_times_ms": tr["times_ms"], "steady_times_ms": steady,
                       "l3_records": l3["records"], "l3_disk_bytes": l3["disk_bytes"],
                       "l3_bytes_written": l3["bytes_written"]})
        print(f"  grow {have:>7} tokens: step p50 {points[-1]['step_ms_p50']:.1f} ms, "
              f"RSS +{points[-1]['rss_delta_bytes'] / 2**20:.0f} MiB, L3 {l3['disk_bytes'] / 2**30:.2f} GiB", flush=True)
    wall = time.perf_counter() - t_start
    stats = st.stats()
    before_drop = st.l3.stats()
    # the conversation ends: its L3 records die, background compaction gives the space back
    st.drop_sequence(s)
    t0 = time.perf_counter()
    # (this tree's tier composes a Compaction part; an older revision's is one class)
    comp = getattr(st.l3, "_compaction", None)
    busy = ((lambda: comp.job is not None or comp.candidates() or comp.head_mostly_dead()) if comp is not None else
            (lambda: st.l3._job is not None or st.l3._candidates() or st.l3._head_mostly_dead()))
    while busy() and time.perf_counter() - t0 < 60:
        time.sleep(0.05)
    reclaim_s = time.perf_counter() - t0
    l3 = st.l3.stats()
    st.close()
    payload = stats.get("swap_out_l3_bytes", 0) or timed.put_b
    return {"points": points, "wall_s": wall, "budget_fraction": 0.03, "device_tokens": hot,
            "step_time_exponent": fit_exponent([p["context"] for p in points], [p["step_ms_p50"] for p in points]),
            # where the budget holds only sinks and window nothing is scored: a different regime
            "step_time_exponent_scored": fit_exponent([p["context"] for p in points if p["top_k"]],
                                                      [p["step_ms_p50"] for p in points if p["top_k"]]),
            "step_time_exponent_as_before": fit_exponent([p["context"] for p in points if p["top_k"]],
                                                         [p["step_ms_p50_as_before"] for p in points if p["top_k"]]),
            "transient_ms_exponent": fit_exponent([p["context"] for p in points], [p["transient_ms"] for p in points]),
            "transient_swap_in_exponent": fit_exponent([p["context"] for p in points],
                                                       [p["transient_swap_in_blocks"] for p in points]),
            "rss_exponent": fit_exponent([p["context"] for p in points], [max(1, p["rss_delta_bytes"]) for p in points]),
            "rss_beyond_l2_exponent": fit_exponent([p["context"] for p in points],
                                                   [max(1, p["rss_beyond_l2_bytes"]) for p in points]),
            "rss_beyond_l2_bytes_per_token": points[-1]["rss_beyond_l2_bytes"] / have,
            "rss_beyond_l2_bytes_per_l3_record": (points[-1]["rss_beyond_l2_bytes"] / points[-1]["l3_records"]
                                                  if points[-1]["l3_records"] else None),
            "swap_out_GBps": timed.put_b / timed.put_s / 1e9 if timed.put_s else None,
            "swap_in_GBps": timed.get_b / timed.get_s / 1e9 if timed.get_s else None,
            "l3_bytes_written_per_token": before_drop["bytes_written"] / have,
            "write_amplification": (l3["bytes_written"] + l3["checkpoint_bytes_written"]) / max(1, timed.put_b),
            "compaction_bytes_written": l3["compact_bytes_written"], "l3_payload_bytes": timed.put_b,
            "l3_disk_bytes_before_drop": before_drop["disk_bytes"], "l3_disk_bytes_after_drop": l3["disk_bytes"],
            "reclaim_seconds_after_drop": reclaim_s, "l3_records_after_drop": l3["records"],
            "payload_bytes_swapped_out": payload}


def run_convs(a, shape, root: str) -> dict:
    """--convs conversations stored once (L1 sized for all of them), then decode steps with the
    first 1, 2, 4, ... of them active: store time per step and conversation against how many."""
    layers = shape[0]
    budget = max(a.block_tokens * 4, int(0.03 * a.conv_tokens) // a.block_tokens * a.block_tokens)
    per_tok = 2 * shape[1] * shape[3] * 2 * layers
    hot = max(budget, (int(a.l1_gib * (1 << 30)) // (per_tok * a.convs)) // a.block_tokens * a.block_tokens)
    d = os.path.join(root, "convs")
    st = make_store(a, shape, d, hot, budget, a.convs)
    if budget // a.block_tokens + 1 > st.layout.low:
        # the watermarks evict part of every step's selection: each step swaps it back in
        print(f"  note: each conversation's L1 ({hot} tokens, {st.layout.low} blocks kept at the low "
              f"watermark) barely holds its budget ({budget} tokens): raise --l1-gib", flush=True)
    timed = Timed(st.l3)
    src = KVSource(shape, 1024, seed=1)
    prefix_ids = np.arange(a.prefix_tokens, dtype=np.int64)
    seqs = []
    t0 = time.perf_counter()
    for i in range(a.convs):
        s = st.add_sequence()
        own = np.arange(10**6 * (i + 1), 10**6 * (i + 1) + a.conv_tokens - a.prefix_tokens, dtype=np.int64)
        st.note_tokens(s, np.concatenate([prefix_ids, own]))
        prefill(st, s, layers, src, a.prefix_tokens)  # the same prefix KV: shared blocks
        prefill(st, s, layers, src, a.conv_tokens - a.prefix_tokens, offset=7 + i)
        seqs.append(s)
    fill_s = time.perf_counter() - t0
    out = []
    counts = [c for c in (1, 2, 4, 8, 16, 32) if c < a.convs] + [a.convs]
    for c in counts:
        active = seqs[:c]
        tr = settle(st, active, layers, src, budget)
        sw0, cp0, mv0 = st.counters["swap_in_blocks"], st.counters["gather_copies"], st.counters["region_moves"]
        times = sorted(decode_step(st, active, layers, src, budget) / c for _ in range(a.steps))
        swaps = (st.counters["swap_in_blocks"] - sw0) / a.steps / c
        copies = (st.counters["gather_copies"] - cp0) / a.steps / c
        moves = (st.counters["region_moves"] - mv0) / a.steps / c
        out.append({"conversations": c, "step_ms_p50_per_conv": times[len(times) // 2] * 1e3,
                    "step_ms_p99_per_conv": times[min(len(times) - 1, int(0.99 * len(times)))] * 1e3,
                    "swap_in_blocks_per_step_per_conv": swaps, "gather_copies_per_step_per_conv": copies,
                    "region_moves_per_step_per_conv": moves, "transient_steps": tr["steps"],
                    "transient_swap_in_blocks_per_conv": tr["swap_in_blocks"] / c})
        print(f"  {c} conversation(s): step p50 {out[-1]['step_ms_p50_per_conv']:.1f} ms per conversation",
              flush=True)
    st.flush()
    stats = st.stats()
    l3 = st.l3.stats()
    st.close()
    shutil.rmtree(d, ignore_errors=True)
    tokens = a.convs * a.conv_tokens
    return {"points": out, "budget_tokens": budget, "device_tokens": hot, "low_watermark_blocks": st.layout.low,
            "fill_s": fill_s, "tokens": tokens,
            "dedup_seals": stats.get("prefix", {}).get("dedup_seals"), "l3_disk_bytes": l3["disk_bytes"],
            "l3_bytes_written_per_token": l3["bytes_written"] / tokens,
            "swap_out_GBps": timed.put_b / timed.put_s / 1e9 if timed.put_s else None,
            "swap_in_GBps": timed.get_b / timed.get_s / 1e9 if timed.get_s else None,
            "step_time_exponent": fit_exponent([p["conversations"] for p in out],
                                               [p["step_ms_p50_per_conv"] for p in out])}


_REOPEN_CHILD = r"""
import importlib.util, json, sys, time
which, path = sys.argv[1], sys.argv[2]
if which == "base":
    spec = importlib.util.spec_from_file_location("kvtier.tiers._disk_base", sys.argv[3])
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    DiskTier = mod.DiskTier
else:
    from kvtier.tiers import DiskTier
    if which == "scan":
        import os; os.unlink(os.path.join(path, "INDEX"))
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
r0 = rss()
t0 = time.perf_counter()
t = DiskTier(path, capacity_bytes=8 << 30, durability="never")
dt = time.perf_counter() - t0
n = len(t)
r1 = rss()
if which != "base":
    t.close()  # writes the checkpoint back for the next run
print(json.dumps({"seconds": dt, "records": n, "rss_delta_bytes": r1 - r0}))
"""


def _reopen_here(which: str, path: str, base_src: str | None) -> dict:
    import importlib.util

    from kvtier.tiers import DiskTier

    cls = DiskTier
    if which == "base":
        spec = importlib.util.spec_from_file_location("kvtier.tiers._disk_base", base_src)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        cls = mod.DiskTier
    elif which == "scan":
        os.unlink(os.path.join(path, "INDEX"))
    r0 = rss_bytes()
    t0 = time.perf_counter()
    t = cls(path, capacity_bytes=8 << 30, durability="never")
    dt = time.perf_counter() - t0
    out = {"seconds": dt, "records": len(t), "rss_delta_bytes": rss_bytes() - r0}
    t.close()
    return out


def run_reopen(a, root: str, base_src: str | None = None) -> dict:
    """Reopening ``a.reopen_records`` small records from the index checkpoint and by a full scan
    of the same files (and first with the DiskTier of ``base_src``, a ``disk.py``, where given)."""
    from kvtier.tiers import DiskTier

    d = os.path.join(root, "reopen")
    t = DiskTier(d, capacity_bytes=8 << 30, durability="never")
    v = os.urandom(40)
    for i in range(0, a.reopen_records, 20_000):
        t.put_many([(f"m{j:032x}/0/{j:032x}"[:40], v) for j in range(i, min(a.reopen_records, i + 20_000))])
    t.close()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    res = {"records": a.reopen_records}
    order = ["checkpoint", "scan"] + ([] if a.smoke else ["checkpoint"])
    if base_src is not None:
        order = ["base"] + order
    for which in order:  # the scan run's close writes the checkpoint again for the last run
        if a.smoke:  # in this process: a child's interpreter start would take most of the smoke time
            out = _reopen_here(which, d, base_src)
        else:
            r = subprocess.run([sys.executable, "-c", _REOPEN_CHILD, which, d, base_src or ""], capture_output=True,
                               text=True, env=env)
            if r.returncode != 0:
                raise RuntimeError(f"reopen child ({which}) failed: {r.stderr[-2000:]}")
            out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["records"] == a.reopen_records, out
        prev = res.get(which)
        if prev is None or out["seconds"] < prev["seconds"]:
            res[which] = {"seconds": out["seconds"], "us_per_record": out["seconds"] / out["records"] * 1e6,
                          "rss_delta_bytes": out["rss_delta_bytes"]}
    if "base" in res:
        res["speedup_vs_base"] = res["base"]["seconds"] / res["checkpoint"]["seconds"]
    res["speedup_vs_scan"] = res["scan"]["seconds"] / res["checkpoint"]["seconds"]
    shutil.rmtree(d, ignore_errors=True)
    return res


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    g = out.get("grow", {}).get("points", [])
    if g:
        x = [p["context"] for p in g]
        ax[0].loglog(x, [p["step_ms_p50"] for p in g], "o-", label="p50")
        ax[0].loglog(x, [p["step_ms_p99"] for p in g], "s--", label="p99")
        ax[0].loglog(x, [p["transient_ms"] for p in g], "^:", label="steps after the prefill, total")
        gb = out.get("grow_base", {}).get("points", [])
        if gb:
            xb = [p["context"] for p in gb]
            ax[0].loglog(xb, [p["step_ms_p50"] for p in gb], "o-", alpha=0.5,
                         label=f"p50, {out['grow_base']['commit']}")
            ax[0].loglog(xb, [p["transient_ms"] for p in gb], "^:", alpha=0.5,
                         label=f"after the prefill, {out['grow_base']['commit']}")
        ax[0].set(xlabel="context (tokens)", ylabel="store ms per decode step",
                  title=f"one sequence (steady k={fmt(out['grow']['step_time_exponent_scored'])}, "
                        f"after prefill k={fmt(out['grow']['transient_ms_exponent'])})")
        ax[0].legend()
        ax[2].loglog(x, [max(1, p["rss_delta_bytes"]) / 2**20 for p in g], "o-", label="RSS growth")
        ax[2].loglog(x, [max(1, p["rss_beyond_l2_bytes"]) / 2**20 for p in g], "^-", label="RSS beyond the L2 arena")
        on_disk = [(p["context"], p["l3_disk_bytes"] / 2**20) for p in g if p["l3_disk_bytes"]]  # log axis: no zeros
        ax[2].loglog([c for c, _ in on_disk], [b for _, b in on_disk], "s--", label="L3 on disk")
        ax[2].set(xlabel="tokens stored", ylabel="MiB", title="memory and disk against tokens")
        ax[2].legend()
    c = out.get("convs", {}).get("points", [])
    if c:
        ax[1].loglog([p["conversations"] for p in c], [p["step_ms_p50_per_conv"] for p in c], "o-")
        ax[1].set(xlabel="concurrent conversations", ylabel="store ms per decode step, per conversation",
                  title=f"conversations (k={fmt(out['convs']['step_time_exponent'])})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None, base: Base | None = None) -> int:
    """The run; ``base`` measures an older store beside this tree's (see :class:`Base`)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="small sizes, under 30 s (CI)")
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="use only the first N layers of the shape")
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=131072)
    ap.add_argument("--convs", type=int, default=8)
    ap.add_argument("--conv-tokens", type=int, default=32768)
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8, help="decode steps measured per point")
    ap.add_argument("--codec", default="int4", help="codec below L1 (bf16 = lossless: about 3.5x the bytes on L3)")
    ap.add_argument("--prefetch-blocks", type=int, default=64,
                    help="decoded blocks the store may hold for the next step (prefetches, and blocks read "
                         "into scratch slots while a region is full)")
    ap.add_argument("--l1-gib", type=float, default=2.0)
    ap.add_argument("--l2-gib", type=float, default=8.0)
    ap.add_argument("--disk-gib", type=int, default=40)
    ap.add_argument("--reopen-records", type=int, default=1_000_000)
    ap.add_argument("--only", choices=("grow", "convs", "reopen"), action="append")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--out", default="results/bench_scale", help="where the JSON and PNG go")
    a = ap.parse_args(argv)
    if a.smoke:
        a.layers, a.max_tokens, a.convs, a.conv_tokens, a.prefix_tokens = 4, 4096, 2, 1024, 256
        a.steps, a.l1_gib, a.l2_gib, a.disk_gib, a.reopen_records = 3, 1 / 64, 1 / 128, 4, 20_000
    a.marks = [m for m in (2 ** k for k in range(8, 24)) if a.max_tokens // 16 <= m < a.max_tokens] + [a.max_tokens]
    for name in ("max_tokens", "convs", "conv_tokens", "steps", "reopen_records", "block_tokens"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < a.prefix_tokens < a.conv_tokens:
        raise SystemExit("--prefix-tokens must be in (0, --conv-tokens)")
    layers, kvh, qh, hd = SHAPES[a.shape]
    shape = (a.layers or layers, kvh, qh, hd)
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="kvtier-scale-", dir=a.dir)
    out: dict = {"shape": {"name": a.shape, "layers": shape[0], "kv_heads": kvh, "head_dim": hd, "dtype": "bf16"},
                 "codec": a.codec, "l1_gib": a.l1_gib, "l2_gib": a.l2_gib, "smoke": a.smoke,
                 "args": {k: v for k, v in vars(a).items() if k != "marks"}}
    try:
        out["raw_disk"] = raw_disk(root, (64 if a.smoke else 1024) << 20)
        todo = a.only or ["grow", "convs", "reopen"]
        if "grow" in todo:
            got = base.grow(a, root) if base is not None else None  # first: the child's memory must
            if got is not None:  # not add to what this process holds after its run
                out["grow_base"] = got
            out["grow"] = run_grow(a, shape, root)
            for k in ("swap_out_GBps", "swap_in_GBps"):
                v = out["grow"][k]
                # the store's L3 runs with durability="never" and reads what it wrote recently:
                # page-cache writes and reads are the like-for-like references
                ref = out["raw_disk"]["raw_write_GBps" if "out" in k else "raw_read_warm_GBps"]
                out["grow"][k.replace("GBps", "ratio_to_raw")] = v / ref if v else None
            shutil.rmtree(os.path.join(root, "grow"), ignore_errors=True)
        if "convs" in todo:
            out["convs"] = run_convs(a, shape, root)
        if "reopen" in todo:
            out["reopen"] = run_reopen(a, root, base.reopen_src(root) if base is not None else None)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_scale.json"), "w") as f:
        json.dump(out, f, indent=1)
    plot(out, os.path.join(a.out, "bench_scale.png"))
    print(json.dumps({k: v for k, v in out.items() if k not in ("grow", "grow_base", "convs")}, indent=1))
    for k in ("grow", "grow_base", "convs"):
        if k in out:
            print(k, json.dumps({kk: vv for kk, vv in out[k].items() if kk != "points"}, indent=1))
    print(f"wrote {a.out}/bench_scale.json and bench_scale.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
