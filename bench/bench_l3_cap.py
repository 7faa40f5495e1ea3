"""A bounded L3 under a multi-conversation trace: eviction order and admission, side by side.

The trace: ``--conversations`` chats (20), each opening with one of 3 system prompts (the first
one pinned with a PINS entry, as ``kvtier cache pin`` writes it), 1 to 5 turns each (turns drawn
at random; a chat of one turn is a one-off prompt), interleaved at random. A turn looks its whole
prefix up in L3 (``get_many``: system prompt, then the chat's earlier turns), "recomputes" what
missed and offers it back (``offer_many``, as the store's write-through and the vLLM connector's
writer do), then offers the turn's new blocks. Every block is ``--layers`` records (one per
layer, content keys ``fp/layer/hash``). L3 is capped at a quarter of the trace's working set
(every distinct block once).

Reported per configuration (eviction x admission), each as a ratio to lru/always in the same run:
block hit rate of the lookups, SSD bytes written (records + compaction copies), the most bytes
the segment files held (sampled after every turn; must stay <= the cap) and whether the pinned
prompt is still whole at the end.

    python bench/bench_l3_cap.py            # 20 chats, 16 KiB blocks x 4 layers
    python bench/bench_l3_cap.py --smoke    # seconds; run by `make bench-smoke`
"""
from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import sys
import tempfile
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvtier.tiers import DiskTier  # noqa: E402
from kvtier.tiers.disk.pins import PinFile  # noqa: E402

FP = "m" + "0" * 32


@dataclass
class Trace:
    turns: list[tuple[int, list[str], list[str]]]  # (chat, prefix block hashes, new block hashes)
    prompts: list[list[str]]  # the system prompts' block hashes
    blocks: int  # distinct blocks in the trace


def _h(*parts) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


def make_trace(chats: int = 20, prompt_blocks: int = 8, turn_blocks: int = 3, seed: int = 0) -> Trace:
    rng = random.Random(seed)
    prompts = [[_h("sys", p, b) for b in range(prompt_blocks)] for p in range(3)]
    plan = []  # (chat, turns)
    for c in range(chats):
        plan.append((c, rng.choice([1, 1, 2, 3, 4, 5])))
    pending = {c: [_h("chat", c, t, b) for t in range(n) for b in range(turn_blocks)] for c, n in plan}
    history = {c: list(prompts[c % 3]) for c, _ in plan}
    queue = [c for c, n in plan for _ in range(n)]
    rng.shuffle(queue)
    turns = []
    for c in queue:
        new = pending[c][:turn_blocks]
        pending[c] = pending[c][turn_blocks:]
        turns.append((c, list(history[c]), new))
        history[c] += new
    distinct = {h for p in prompts for h in p} | {h for _, pre, new in turns for h in pre + new}
    return Trace(turns, prompts, len(distinct))


def keys(h: str, layers: int) -> list[str]:
    return [f"{FP}/{layer}/{h}" for layer in range(layers)]


def run(trace: Trace, path: str, eviction: str, admission: str, layers: int, block_bytes: int) -> dict:
    """Replay ``trace`` on a fresh L3 at ``path`` capped at a quarter of its working set."""
    working = trace.blocks * layers * (block_bytes + 128)
    cap = max(working // 4, 64 << 10) // 4096 * 4096
    seg = max(4096, cap // 8 // 4096 * 4096)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, mode=0o700)
    PinFile(path).add("system-prompt-0", [k for h in trace.prompts[0] for k in keys(h, layers)])
    value = bytes(block_bytes)
    l3 = DiskTier(path, capacity_bytes=cap, segment_bytes=seg, durability="never", eviction=eviction,
                  admission=admission)
    hits = lookups = most = 0
    try:
        for _, prefix, new in trace.turns:
            ks = [k for h in prefix for k in keys(h, layers)]
            got = l3.get_many(ks)
            lookups += len(prefix)
            missed = []
            for b, h in enumerate(prefix):
                if all(v is not None for v in got[b * layers:(b + 1) * layers]):
                    hits += 1
                else:
                    missed.append(h)
            l3.offer_many([(k, value) for h in missed + new for k in keys(h, layers)])
            most = max(most, l3.disk_bytes)
        st = l3.stats()
        pinned_whole = all(l3.contains(k) for h in trace.prompts[0] for k in keys(h, layers))
    finally:
        l3.close()
    return dict(eviction=eviction, admission=admission, cap=cap, working=working, hit_rate=hits / max(1, lookups),
                written=st["bytes_written"] + st["compact_bytes_written"], record_bytes=st["bytes_written"],
                most_disk=most, evictions=st["evictions"], refused=st["admission_refused"], pinned=pinned_whole)


CONFIGS = [("lru", "always"), ("lru", "second-touch"), ("lfu", "always"), ("lfu", "second-touch"),
           ("none", "always")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="small blocks, for CI")
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--block-kib", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=3, help="traces averaged (each its own interleaving)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.block_kib, args.seeds, args.layers = 2, 1, 2
    tmp = tempfile.mkdtemp(prefix="kvtier-l3cap-")
    try:
        rows = {c: [] for c in CONFIGS}
        for seed in range(args.seeds):
            trace = make_trace(args.conversations, seed=seed)
            for ev, adm in CONFIGS:
                rows[(ev, adm)].append(run(trace, os.path.join(tmp, "l3"), ev, adm, args.layers,
                                           args.block_kib << 10))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    first = rows[CONFIGS[0]][0]
    print(f"{args.conversations} chats, 3 system prompts (one pinned), {args.seeds} trace(s); L3 cap "
          f"{first['cap']:,} B = 1/4 of the working set {first['working']:,} B")
    base = rows[CONFIGS[0]]
    mean = lambda rs, f: sum(r[f] for r in rs) / len(rs)  # noqa: E731
    print(f"{'eviction':9} {'admission':13} {'hit rate':>8} {'x lru/always':>12} {'SSD written':>12} "
          f"{'x lru/always':>12} {'max disk/cap':>12} {'pinned kept':>11}")
    ok = True
    for c, rs in rows.items():
        hr, wr = mean(rs, "hit_rate"), mean(rs, "written")
        top = max(r["most_disk"] / r["cap"] for r in rs)
        pinned = all(r["pinned"] for r in rs)
        ok &= top <= 1.0 and (pinned or c[0] == "none")
        print(f"{c[0]:9} {c[1]:13} {hr:8.3f} {hr / max(1e-9, mean(base, 'hit_rate')):12.2f} {wr:12,.0f} "
              f"{wr / mean(base, 'written'):12.2f} {top:12.2f} {str(pinned):>11}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
