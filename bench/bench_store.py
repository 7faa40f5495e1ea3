"""Store overhead in a synthetic decode loop at SmolLM2's shape (30 layers, 3 KV heads, head_dim 64).

Reference, measured in the same run: an all-in-L1 decode step (K/V preallocated on the device,
each layer appends one token and attends to every token). The store run keeps only a fraction of
the KV in L1 (the rest int4 in L2 and L3) and attends in sparse mode (sinks + window + top-k
blocks by key digest); each layer calls append, select, gather_view and observe, then the step
calls end_step.

Reported, per (context, L1 fraction):
  store/ref      time inside store calls / reference time, per step (median over steps; both run
                 back to back on the same tokens, so machine load hits them alike)  (target <= 0.20)
  step/ref       whole sparse step (store + its attention) / reference step
  p99/p50        of the store run's step times (TPOT jitter, target <= 2)
  per layer      median us per layer and step of append, select, gather_view, observe, end_step
                 (end_step's step time / layers), next to the reference's
  swap in/out    bytes per step; prefetch precision and coverage; misses per step
                 (prefetch follows the config's "auto": off for a CPU store; --prefetch forces it)

Then, per --swap-in-shape, a decode step's swap-in of a layer's selected blocks from L3 at a
small-record shape (one layer's int4 block: SmolLM2's 5.4 KiB, Llama-3-8B's 18 KiB):
``gather_blocks`` of ``--swap-in-blocks`` random sealed blocks of a sequence whose blocks only
L3 holds, batched (this tree: one ``get_many`` for the step's blocks, decoded into one tensor,
room made in L1 with one choice of victims), forced per record (one ``get`` a block, the store's
path before batching) and ``one_by_one`` (the batched read, but each record decoded into its own
tensor and each install choosing its own victim: the path before batched decode), alternated step
by step. Reported as medians over steps of ratios to a
raw read of the same bytes right after each step (one ``pread`` per record of the values the
step's L3 calls returned, at their places in the segment files, warm):
  l3 read/raw    raw time / time in the L3 tier calls of the swap-in  (target >= 0.7)
  swap-in/raw    raw time / the whole swap-in (L3 read, CRC, decode, install into L1)

    python bench/bench_store.py            # 4k and 16k context, L1 at 10% and 25%
    python bench/bench_store.py --smoke    # seconds; run by `make bench-smoke`
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time

import torch

from kvtier.config import KVTierConfig
from kvtier.store import KVStore

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 30, 3, 9, 64
CALLS = ("append", "select", "gather", "observe", "end_step")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q [q_heads, 1, hd], k/v [kv_heads, n, hd] -> out [q_heads, 1, hd], mass per token [n]."""
    g = q.shape[0] // k.shape[0]
    qg = q.reshape(k.shape[0], g, q.shape[-1])  # [kv_heads, groups, hd]
    p = torch.softmax(qg @ k.transpose(1, 2) * (1.0 / math.sqrt(q.shape[-1])), dim=-1)  # [kv_heads, g, n]
    return (p @ v).reshape(q.shape), p.sum(dim=(0, 1))


class Stream:
    """Synthetic K/V/queries with the structure attention has in practice: per layer a direction
    that queries lean towards (drifting slowly), and a minority of "heavy" token positions (the
    same positions in every layer, as sinks and delimiter tokens are) whose keys share it.
    ``heavy=0`` gives structureless keys: every step's top-k is a fresh draw (the worst case)."""

    def __init__(self, dtype: torch.dtype, device: torch.device, heavy: float, bt: int, seed: int = 0) -> None:
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.dtype, self.device, self.heavy, self.bt = dtype, device, heavy, bt
        u = torch.randn(LAYERS, KV_HEADS, HEAD_DIM, generator=self.gen)
        self.u = u / u.norm(dim=-1, keepdim=True)  # [layers, kv_heads, hd]
        groups = Q_HEADS // KV_HEADS
        self.q_dir = self.u.repeat_interleave(groups, dim=1)[:, :, None, :]  # [layers, q_heads, 1, hd]
        self.noise = torch.randn(LAYERS, Q_HEADS, 1, HEAD_DIM, generator=self.gen) * 0.5
        self.pos = 0
        self.block_heavy: dict[int, bool] = {}

    def heavy_mask(self, start: int, n: int) -> torch.Tensor:
        """Heavy token positions in [start, start+n): a quarter of the tokens of heavy blocks."""
        out = torch.zeros(n, dtype=torch.bool)
        if self.heavy <= 0:
            return out
        for i in range(n):
            b = (start + i) // self.bt
            if b not in self.block_heavy:
                self.block_heavy[b] = bool(torch.rand(1, generator=self.gen) < self.heavy)
            out[i] = self.block_heavy[b] and bool(torch.rand(1, generator=self.gen) < 0.25)
        return out

    def kv(self, layer: int, n: int, mask: torch.Tensor):
        """n new tokens of one layer: k, v [kv_heads, n, hd]."""
        k = torch.randn(KV_HEADS, n, HEAD_DIM, generator=self.gen)
        v = torch.randn(KV_HEADS, n, HEAD_DIM, generator=self.gen)
        k[:, mask] += 6.0 * self.u[layer][:, None, :]
        return k.to(self.device, self.dtype), v.to(self.device, self.dtype)

    def prefill(self, n: int):
        mask = self.heavy_mask(self.pos, n)
        self.pos += n
        return [self.kv(layer, n, mask) for layer in range(LAYERS)]

    def step(self):
        """One decode step: queries [layers, q_heads, 1, hd] and one token per layer."""
        self.noise = 0.9 * self.noise + 0.2 * torch.randn(self.noise.shape, generator=self.gen)
        q = 3.0 * self.q_dir + self.noise
        mask = self.heavy_mask(self.pos, 1)
        self.pos += 1
        return q.to(self.device, self.dtype), [self.kv(layer, 1, mask) for layer in range(LAYERS)]


def run(ctx: int, l1_frac: float, budget_frac: float, steps: int, warmup: int, dtype, device, codec: str,
        policy: str, block_tokens: int, heavy: float, disk_dir: str, attention: str = "sparse",
        prefetch: bool | str | None = None) -> dict:
    """Reference and store side by side: every step runs both on the same tokens, so machine
    load hits them alike."""
    bt = block_tokens
    hot = max(4 * bt, int(ctx * l1_frac) // bt * bt)
    budget = max(4 * bt, min(hot, int(hot * budget_frac) // bt * bt))
    total = ctx + warmup + steps
    elem = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * LAYERS * KV_HEADS * HEAD_DIM * elem * total
    # L2 holds about half of the encoded KV (int4 with scales: ~4.5 bits per element); the rest spills to L3
    host = max(1 << 20, int(kv_bytes * 0.5 * 4.5 / (8 * elem)))
    cfg = KVTierConfig(block_tokens=bt, device_tokens=hot, budget_tokens=budget, host_bytes=host,
                       disk_path=disk_dir, disk_bytes=max(64 << 20, 2 * kv_bytes), codec=codec,
                       policy=policy, attention=attention, max_sequences=1,
                       **({} if prefetch is None else {"prefetch": prefetch}))
    st = KVStore(cfg, num_layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype, device=device)
    s = Stream(dtype, device, heavy, bt)
    ks = torch.empty(LAYERS, KV_HEADS, total, HEAD_DIM, dtype=dtype, device=device)
    vs = torch.empty_like(ks)
    seq = st.add_sequence()
    t0 = time.perf_counter()
    for layer, (k, v) in enumerate(s.prefill(ctx)):
        ks[layer, :, :ctx] = k
        vs[layer, :, :ctx] = v
        st.append(seq, layer, k, v)
    st.end_step()
    st.flush()
    prefill_s = time.perf_counter() - t0
    n = ctx
    ref_t, store_t, step_t = [], [], []
    calls = {name: [] for name in CALLS}  # per step, summed over layers (host time; no device sync per call)
    before = None
    for i in range(warmup + steps):
        if i == warmup:
            before = st.stats()
        q, kv = s.step()
        # reference: everything in L1, dense attention
        _sync(device)
        a = time.perf_counter()
        for layer in range(LAYERS):
            k, v = kv[layer]
            ks[layer, :, n:n + 1] = k
            vs[layer, :, n:n + 1] = v
            attend(q[layer], ks[layer, :, : n + 1], vs[layer, :, : n + 1])
        _sync(device)
        ref_step = time.perf_counter() - a
        n += 1
        # store: sparse attention over sinks + window + top-k blocks
        t_step = time.perf_counter()
        t_app = t_sel = t_gat = t_obs = 0.0
        for layer in range(LAYERS):
            k, v = kv[layer]
            a = time.perf_counter()
            st.append(seq, layer, k, v)
            a1 = time.perf_counter()
            if attention == "sparse":
                sel = st.select(seq, layer, q[layer])
                a2 = time.perf_counter()
                kk, vv, _, sel = st.gather_view(seq, layer, sel)  # sel: block order of kk/vv
            else:
                a2 = a1
                kk, vv = st.gather(seq, layer)
                sel = range(-(-kk.shape[1] // bt) - 1)
            b = time.perf_counter()
            _, mass = attend(q[layer], kk, vv)
            nb = len(sel) + (attention != "sparse")  # sparse: the order lists the open block too
            per_block = torch.nn.functional.pad(mass, (0, nb * bt - mass.shape[0])).view(nb, bt).sum(1)
            c = time.perf_counter()
            st.observe(seq, layer, sel, per_block)
            t_app += a1 - a
            t_sel += a2 - a1
            t_gat += b - a2
            t_obs += time.perf_counter() - c
        a = time.perf_counter()
        st.end_step()
        _sync(device)
        end = time.perf_counter()
        if i >= warmup:
            ref_t.append(ref_step)
            store_t.append(t_app + t_sel + t_gat + t_obs + (end - a))
            step_t.append(end - t_step)
            for name, x in zip(CALLS, (t_app, t_sel, t_gat, t_obs, end - a)):
                calls[name].append(x)
    after = st.stats()
    st.close()

    def delta(*path):
        x, y = after, before
        for p in path:
            x, y = x[p], y[p]
        return x - y

    return {
        "device_tokens": hot, "budget_tokens": budget, "host_bytes": host, "prefill_s": prefill_s,
        "ref_s": ref_t, "store_s": store_t, "step_s": step_t,
        # median per layer and step, microseconds (end_step: its per-step time / layers)
        "per_layer_us": {name: pct(x, 0.5) / LAYERS * 1e6 for name, x in calls.items()},
        "ref_per_layer_us": pct(ref_t, 0.5) / LAYERS * 1e6,
        "swap_in_bytes_per_step": (delta("swap_in_bytes", "l2") + delta("swap_in_bytes", "l3")) / steps,
        "swap_out_bytes_per_step": (delta("swap_out_bytes", "l2") + delta("swap_out_bytes", "l3")) / steps,
        "l1_misses_per_step": delta("misses", "l1") / steps,
        "l1_hits_per_step": delta("hits", "l1") / steps,
        "prefetch": after["prefetch"],
        "blocks": after["blocks"],
        "bytes_per_token": after["bytes_per_token"],
        "compression": after["compression"],
        "swap_in_latency": after["swap_in_latency"],
        "swap_out_latency": after["swap_out_latency"],
        "evictions": after["evictions"],
        "scratch_uses_per_step": delta("scratch_uses") / steps,
        "gather": {k: delta("gather", k) / steps for k in ("views", "copies", "moved_blocks")},
    }


# kv_heads, head_dim, block_tokens: one layer's int4 block record, scales included: SmolLM2's 5.4 KiB,
# Llama-3-8B's 18 KiB (fewer tokens a block would not shrink it much: K's scales are per channel)
SWAP_SHAPES = {"smollm2": (3, 64, 16), "llama8b": (8, 128, 8)}


def swap_in(shape: str, ctx: int, blocks: int, steps: int, disk_dir: str) -> dict:
    """A decode step's swap-in of ``blocks`` random blocks of one layer whose blocks only L3
    holds, batched and forced per record, alternated step by step; each step followed by a raw
    read of the same bytes: a ``pread`` per record of the values the step's L3 calls returned,
    from their segment files (see the module docstring)."""
    from kvtier.store import reads

    kvh, hd, bt = SWAP_SHAPES[shape]
    cfg = KVTierConfig(block_tokens=bt, device_tokens=2 * (blocks + 1) * bt, budget_tokens=(blocks + 1) * bt,
                       host_bytes=64 << 10, disk_path=disk_dir, disk_bytes=1 << 30, codec="int4", policy="lru",
                       attention="sparse", max_sequences=1, prefetch=False)
    st = KVStore(cfg, num_layers=1, kv_heads=kvh, head_dim=hd, dtype=torch.float32, device="cpu")
    seq = st.add_sequence()
    g = torch.Generator().manual_seed(0)
    for _ in range(0, ctx, 1024):
        st.append(seq, 0, torch.randn(kvh, 1024, hd, generator=g), torch.randn(kvh, 1024, hd, generator=g))
    st.end_step()
    st.flush()
    l3 = st.offload.l3
    spent = [0.0]          # seconds inside this step's L3 calls
    asked: list[str] = []  # the keys they were asked for

    def get_many(keys):
        asked.extend(keys)
        t0 = time.perf_counter()
        try:
            return batched(keys)
        finally:
            spent[0] += time.perf_counter() - t0

    def get_per_record(keys):
        asked.extend(keys)
        t0 = time.perf_counter()
        try:
            return [get(k) for k in keys]
        finally:
            spent[0] += time.perf_counter() - t0

    def raw_read(keys: list[str]) -> float:
        locs = [l3._catalog.records.lookup(k) for k in keys]  # (segment, record offset, record bytes, value bytes)
        for sid, *_ in locs:
            if sid not in fds:
                fds[sid] = os.open(l3._files.segs[sid].path, os.O_RDONLY)
        t0 = time.perf_counter()
        got = [os.pread(fds[sid], vlen, off + size - vlen) for sid, off, size, vlen in locs]
        dt = time.perf_counter() - t0
        assert all(len(v) == loc[3] for v, loc in zip(got, locs))
        return dt

    batched, get = l3.get_many, l3.get
    keys = list(l3.keys())
    sizes = sorted(l3.value_sizes(keys))
    batched(keys)  # warm reads: every record's pages cached and mapped once, before either mode
    fds: dict[int, int] = {}
    rng = random.Random(0)
    sealed = len(st.residency.tables[seq][0].entries) - 1
    modes = ("batched", "per_record", "one_by_one")
    out: dict[str, list[tuple]] = {m: [] for m in modes}  # (l3 s, swap-in s, raw s, records)
    batch0 = reads._SWAP_IN_BATCH
    io, res = st.offload.io, st.residency
    decode_many, make_room = io.decode_stored_many, res.make_room

    def decode_each(items, device):
        return [io.decode_stored(v, tier, device) for v, tier in items]

    try:
        for i in range(len(modes) * (steps + 1)):
            mode = modes[i % len(modes)]
            io.decode_stored_many = decode_each if mode == "one_by_one" else decode_many
            res.make_room = (lambda *a: None) if mode == "one_by_one" else make_room
            # per record: a swap-in a block, each one L3 get() (the store's path before batching)
            reads._SWAP_IN_BATCH = 1 if mode == "per_record" else batch0
            l3.get_many = get_per_record if mode == "per_record" else get_many
            sel = sorted(rng.sample(range(sealed), blocks))
            hits = st.stats()["hits"]["l3"]
            spent[0] = 0.0
            asked.clear()
            t0 = time.perf_counter()
            st.gather_blocks(seq, 0, sel)
            swap_s = time.perf_counter() - t0
            n = st.stats()["hits"]["l3"] - hits
            assert n == len(asked), "every L3 read of the step was a hit"
            if i >= len(modes) and n:  # the first step of each mode warms up
                out[mode].append((spent[0], swap_s, raw_read(asked), n))
            st.end_step()
    finally:
        reads._SWAP_IN_BATCH = batch0
        del l3.get_many, io.decode_stored_many, res.make_room
        for fd in fds.values():
            os.close(fd)
        st.close()
    row = {"shape": shape, "ctx": ctx, "blocks": blocks, "record_bytes": sizes[len(sizes) // 2]}
    for mode, xs in out.items():
        # paired per step (the raw read right after the swap-in): machine load hits both alike
        row[mode] = {"steps": len(xs), "l3_records_per_step": sum(x[3] for x in xs) / len(xs),
                     "read_over_raw": pct([x[2] / x[0] for x in xs], 0.5),
                     "swap_over_raw": pct([x[2] / x[1] for x in xs], 0.5),
                     "us_per_record": pct([x[1] / x[3] for x in xs], 0.5) * 1e6,
                     "l3_us_per_record": pct([x[0] / x[3] for x in xs], 0.5) * 1e6,
                     "raw_us_per_record": pct([x[2] / x[3] for x in xs], 0.5) * 1e6}
    return row


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * len(s) + 0.5)) - 1))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny run (seconds) for CI")
    ap.add_argument("--ctx", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--l1", type=float, nargs="+", default=[0.10, 0.25], help="L1 share of the KV")
    ap.add_argument("--budget", type=float, default=0.5, help="sparse budget as a share of L1")
    ap.add_argument("--heavy", type=float, default=0.08, help="share of heavy blocks (0: no structure)")
    # p99 of n samples is the ceil(n/100)-th largest: 64 steps would make it the maximum
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--codec", default="int4")
    ap.add_argument("--policy", default="h2o")
    ap.add_argument("--attention", default="sparse", choices=["sparse", "dense"],
                    help="dense: every block every step (swapped in from L2/L3, next layer prefetched)")
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=None,
                    help="asynchronous swap-in of predicted blocks (a second thread decoding on CPU); "
                         "default: the config's 'auto' (on for a GPU store, off on CPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--swap-in-shape", nargs="*", choices=sorted(SWAP_SHAPES), default=sorted(SWAP_SHAPES),
                    help="shapes of the L3 swap-in measurement (none: skip it)")
    ap.add_argument("--swap-in-ctx", type=int, default=16384, help="tokens of the swap-in measurement's sequence")
    ap.add_argument("--swap-in-blocks", type=int, default=64, help="blocks a step swaps in (a sparse step's recall)")
    ap.add_argument("--swap-in-steps", type=int, default=100, help="steps of each mode (batched, per record, one by one)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    if args.smoke:
        args.ctx, args.l1, args.steps, args.warmup = [1024], [0.25], 12, 3
        args.swap_in_shape, args.swap_in_ctx, args.swap_in_steps = ["smollm2"], 4096, 20
    device = torch.device(args.device)
    # fp16 matmuls are slow on CPU; a CPU deployment would run fp32
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    results = []
    print(f"device={device} dtype={dtype} threads={torch.get_num_threads()} codec={args.codec} "
          f"policy={args.policy} attention={args.attention} block_tokens={args.block_tokens} "
          f"prefetch={'auto' if args.prefetch is None else args.prefetch} "
          f"budget={args.budget:.2f} of L1 "
          f"heavy={args.heavy}")
    print(f"{'ctx':>6} {'L1':>5} {'budget':>6} {'ref ms':>8} {'store ms':>9} {'store/ref':>9} {'step/ref':>8} "
          f"{'p99/p50':>7} {'in KB/st':>9} {'out KB/st':>9} {'miss/st':>7} {'pf prec':>7} {'pf cov':>6}")
    for ctx in args.ctx:
        for frac in args.l1:
            d = tempfile.mkdtemp(prefix="kvtier-bench-")
            try:
                r = run(ctx, frac, args.budget, args.steps, args.warmup, dtype, device, args.codec, args.policy,
                        args.block_tokens, args.heavy, os.path.join(d, "l3"), args.attention, args.prefetch)
            finally:
                shutil.rmtree(d, ignore_errors=True)
            ref_p50 = pct(r["ref_s"], 0.5)
            store_p50, step_p50 = pct(r["store_s"], 0.5), pct(r["step_s"], 0.5)
            # paired per step: both ran back to back on the same tokens, so machine load cancels
            paired = sorted(a / b for a, b in zip(r["store_s"], r["ref_s"]))
            row = {
                "ctx": ctx, "l1_frac": frac, "ref_step_ms_p50": ref_p50 * 1e3,
                "store_ms_p50": store_p50 * 1e3, "store_over_ref": pct(paired, 0.5),
                "step_over_ref": step_p50 / ref_p50, "step_p99_over_p50": pct(r["step_s"], 0.99) / step_p50,
                "ref_p99_over_p50": pct(r["ref_s"], 0.99) / ref_p50,
                **{k: v for k, v in r.items() if k not in ("ref_s", "store_s", "step_s")},
            }
            results.append(row)
            pf = r["prefetch"]
            print(f"{ctx:>6} {frac:>5.2f} {r['budget_tokens']:>6} {ref_p50 * 1e3:>8.2f} {store_p50 * 1e3:>9.2f} "
                  f"{row['store_over_ref']:>9.3f} {row['step_over_ref']:>8.3f} {row['step_p99_over_p50']:>7.2f} "
                  f"{r['swap_in_bytes_per_step'] / 1024:>9.1f} {r['swap_out_bytes_per_step'] / 1024:>9.1f} "
                  f"{r['l1_misses_per_step']:>7.1f} {_f(pf['precision']):>7} {_f(pf['coverage']):>6}")
    print("targets (sparse): store/ref <= 0.20 with L1 at 25%, p99/p50 <= 2 "
          "(ref p99/p50 of the same steps: " + ", ".join(f"{r['ref_p99_over_p50']:.2f}" for r in results) + ")")
    print("per layer and step, median us: " + " ".join(f"{c:>8}" for c in CALLS) + "      ref")
    for r in results:
        print(f"  ctx {r['ctx']:>6} L1 {r['l1_frac']:.2f}            "
              + " ".join(f"{r['per_layer_us'][c]:>8.1f}" for c in CALLS) + f" {r['ref_per_layer_us']:>8.1f}")
    swaps = []
    for shape in args.swap_in_shape:
        d = tempfile.mkdtemp(prefix="kvtier-bench-")
        try:
            swaps.append(swap_in(shape, args.swap_in_ctx, args.swap_in_blocks, args.swap_in_steps,
                                 os.path.join(d, "l3")))
        finally:
            shutil.rmtree(d, ignore_errors=True)
    if swaps:
        print(f"L3 swap-in of a step's {args.swap_in_blocks} blocks, ratios to a pread of the same bytes "
              "(target: l3 read/raw >= 0.7)")
        print(f"{'shape':>8} {'record B':>8} {'mode':>10} {'l3/step':>7} {'l3 read/raw':>11} {'swap-in/raw':>11} "
              f"{'us/block: swap-in':>17} {'l3':>6} {'raw':>6}")
        for r in swaps:
            for mode in ("batched", "per_record", "one_by_one"):
                m = r[mode]
                print(f"{r['shape']:>8} {r['record_bytes']:>8} {mode:>10} {m['l3_records_per_step']:>7.1f} "
                      f"{m['read_over_raw']:>11.2f} {m['swap_over_raw']:>11.3f} {m['us_per_record']:>17.1f} "
                      f"{m['l3_us_per_record']:>6.1f} {m['raw_us_per_record']:>6.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"decode": results, "swap_in": swaps}, fh, indent=2)
    return 0


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    sys.exit(main())
