"""Sequence surgery: cut a sequence back anywhere (crop), fork one sharing its sealed blocks.

What ``TieredCache.crop`` / ``fork`` / ``copy.deepcopy`` and the batch methods need. Tables,
entries and copy records change under the state lock through the lock-held helpers of Residency
and its CopyRecords (a cut or dropped block's last reference lists its copies for deletion;
content-addressed L3 copies stay for later prefix matches), as Regions does; tier I/O (a
swap-in for the block a cut reopens, deleting copies) goes through OffloadTiers without that
lock, in the store's order (tier lock before state lock).

```
 truncate to 1.5 blocks          before  [ b0 ][ b1 ][ b2 ][ b3 open ]
   b2, b3 unreferenced, b1 reopen  after   [ b0 ][ b1 open: bt/2 tokens ]
 fork                            src     [ e0 ][ e1 ][ open ]     e0.rec, e1.rec: refs + 1
                                 dst     [ e0'][ e1'][ open' ]    open': its own copy (COW)
```
"""
from __future__ import annotations

import torch

from .keys import block_key
from .table import BlockCopies, BlockEntry, BlockTable


class SequenceSurgery:
    def __init__(self, residency, offload, evictor, content) -> None:
        self.residency = residency
        self.offload = offload
        self.evictor = evictor
        self.content = content

    def truncate(self, tables: list[BlockTable], length: int) -> None:
        """Cut every table longer than ``length`` back to it (nothing of its blocks in flight)."""
        for t in [t for t in tables if t.length > length]:
            self.cut(t, length)
        self.content.truncate(tables[0].seq, length)

    def cut(self, t: BlockTable, length: int, reopened: torch.Tensor | None = None) -> None:
        """Cut ``t`` back to ``length`` tokens (nothing of its blocks in flight); the token ids
        noted for its sequence are the caller's to cut. ``reopened``: the L1 data
        [2, kv_heads, block_tokens, head_dim] of the block that becomes the open one, when the
        caller has it (an append undone: its copy below L1 may be lossy), instead of reading it from
        that copy; a block still resident keeps its slot's data."""
        residency = self.residency
        bt = residency.layout.block_tokens
        keep = -(-length // bt)  # blocks left, the last one open
        drop2, drop3 = [], []
        reopen = keep and keep < len(t.entries)  # a sealed block becomes the open one
        with residency.lock:
            for e in t.entries[keep:]:
                self._unlink(t, e, drop2, drop3)
            del t.entries[keep:]
            t.length = min(t.length, keep * bt)
            t.gather_cache = t.view_cache = None
            t.view_n = 0
        fresh = None
        if reopen:
            e = t.entries[-1]
            if e.slot is None:
                data = self.offload.load(e) if reopened is None else reopened
                self.evictor.make_room(t, 1)
                with residency.lock:
                    residency._place(t, e, data)
        if keep:
            e = t.entries[-1]
            # cut inside the block that is open now: the next append makes new content (an
            # undone append may have sealed it, even without opening the next one)
            if length < keep * bt:
                with residency.lock:
                    residency.copies.release(e, drop2, drop3, keep_content=True)
                    fresh = BlockCopies(e.key)
                    e.held = False  # new content: a failed swap-out of the old says nothing of it
        if drop2 or drop3:
            self.offload.delete(drop2, drop3)
        with residency.lock:
            if fresh is not None:  # registered only now: its key may have named a dropped copy
                e.rec = fresh
                fresh.entries.append(e)
                residency.copies.add(fresh)
            t.length = length
            if t.entries:
                residency._open_views(t)
            else:
                t.open_view = t.open_np = None
            residency.touched[id(t)] = t

    def fork(self, src: list[BlockTable], dst: list[BlockTable]) -> None:
        """Fill the empty tables ``dst`` from ``src``: shared copies below L1, own L1 slots."""
        with self.residency.lock:
            for s, d in zip(src, dst):
                self._fork_table(s, d)
        self.content.fork(src[0].seq, dst[0].seq)

    def _fork_table(self, s: BlockTable, d: BlockTable) -> None:
        residency = self.residency
        src_slots, dst_slots = [], []
        last = len(s.entries) - 1
        for e in s.entries:
            n = BlockEntry(e.idx, block_key(d.seq, d.layer, e.idx))
            if e.idx < last:  # sealed: the same content, one more reference
                n.rec.entries.remove(n)
                n.rec = e.rec
                e.rec.entries.append(n)
            else:
                residency.copies.add(n.rec)
            n.last_used, n.mass, n.importance = e.last_used, e.mass, e.importance
            d.entries.append(n)
            residency.by_key[n.key] = n
            if e.slot is not None:
                slot = d.base + (e.slot - s.base)  # the same region position
                if not residency.l1.put_at(n.key, slot, None):
                    raise RuntimeError(f"kvtier: L1 refused fresh region slot {slot} of {d.seq}/{d.layer}")
                d.take_slot(n, slot)
                n.low_gen = e.low_gen  # its L1 data: a copy of e's (below)
                src_slots.append(e.slot)
                dst_slots.append(slot)
            residency._count_home(n.home, 1)
        if src_slots:
            pool = residency.l1.storage  # [2, kv_heads, slots, block_tokens, head_dim]
            dev = pool.device
            pool[:, :, torch.tensor(dst_slots, device=dev)] = pool.index_select(2, torch.tensor(src_slots, device=dev))
        d.length = s.length
        d.observed = s.observed
        d.copy_digest_from(s)
        if d.entries:
            residency._open_views(d)
        residency.touched[id(d)] = d

    def _unlink(self, t: BlockTable, e: BlockEntry, drop2: list, drop3: list) -> None:
        """Entry ``e`` leaves ``t``: its L1 slot and its reference (lock held)."""
        residency = self.residency
        residency._count_home(e.home, -1)
        if e.slot is not None:
            residency.l1.delete(e.key)
            t.free_slot(e)
        residency.copies.release(e, drop2, drop3, keep_content=True)
        residency.by_key.pop(e.key, None)
