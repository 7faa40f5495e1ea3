"""Eviction: watermark victims at the step boundary, room for a new block, and the swap-out worker.

Victims are chosen by the policy and marked by ``Residency``; dirty ones are encoded (host codec,
or with ``precision="importance"`` the codec chosen when they were marked; byte stage if
``byte_stage_l2``) and put to L2 by the worker thread, off the decode path. A block stored below
the base codec also gets its base-codec backup in L3 (``precision.py``). The decode path waits
for the worker only when a table's L1 region is truly full.
"""
from __future__ import annotations

import time

import torch

from .blockio import BlockIO
from .blockrecord import pack_block
from .layout import Layout
from .offload import OffloadTiers
from .residency import Residency
from .stats import Counters
from .swap import SwapOutWorker
from .table import BlockTable


class Evictor:
    def __init__(self, layout: Layout, residency: Residency, io: BlockIO, offload: OffloadTiers,
                 counters: Counters, batch_blocks: int) -> None:
        self.layout = layout
        self.residency = residency
        self.copies = residency.copies  # under the same (state) lock
        self.io = io
        self.offload = offload
        self.counters = counters
        self.l1 = residency.l1
        self._side = torch.cuda.Stream(device=layout.device) if layout.cuda else None
        self.worker = SwapOutWorker(self._swap_out_batch, batch_blocks)

    def end_step(self) -> None:
        """Evict every touched table over the high watermark down to the low one (asynchronously)."""
        self.worker.submit(self.residency.watermark_victims())

    def make_room(self, t: BlockTable, need: int, exclude=frozenset()) -> None:
        """Ensure ``need`` more blocks of ``t`` fit in L1. Waits only when L1 is truly full."""
        device_blocks = self.layout.device_blocks
        while t.resident + need > device_blocks:
            over = t.resident + need - device_blocks
            self.residency.free_clean_victims(t, over, exclude)
            if t.resident + need <= device_blocks:
                return
            self.counters.add(sync_evictions=1)
            if t.pending:
                self.worker.drain()
                continue
            items = self.residency.mark_victims(t, max(over, t.resident - t.pending - self.layout.low),
                                          exclude, force=True)
            # read before submitting: the worker may finish the batch before this thread runs on
            before = t.resident
            self.worker.submit(items)
            if not items:
                if t.resident + need <= device_blocks:
                    return  # the victims were clean: freed at once
                held = self.residency.held_blocks(t)
                if held:  # the failure that did it, if not raised yet, is raised with it
                    raise RuntimeError(
                        f"kvtier: the L1 budget of sequence {t.seq} layer {t.layer} is full: {held} of its "
                        f"blocks failed to swap out and stay in L1; drop or truncate the sequence"
                    ) from self.residency.take_failure(t.seq)
                raise AssertionError(f"L1 full for {t.seq}/{t.layer} with nothing evictable")
            self.worker.drain()
            if t.resident >= before and not any(e.held for _, e in items):
                why = ("host_bytes (and host_overflow_bytes) full and L3 full or refusing records (see the "
                       "warning above): raise host_bytes or disk_bytes, or free space under disk_path"
                       if self.offload.l3 is not None else
                       "host_bytes full and no L3: raise host_bytes or set disk_path")
                raise RuntimeError(f"kvtier: L1 budget full and L2 refused the blocks ({why})")
            # blocks whose swap-out failed are held in L1: the next round chooses others

    def drain(self) -> None:
        self.worker.drain()

    def wait(self) -> None:
        """Wait for the worker without raising its kept error (an undo after a failure)."""
        self.worker.wait()

    def close(self) -> None:
        self.worker.close()

    # -- worker thread -------------------------------------------------------------------------

    def _swap_out_batch(self, batch: list) -> None:
        """Encode and put ``batch``'s (table, entry) items to L2, each settled on its own: a block
        whose encoding, framing or put raises stays in L1 (``Residency.swap_failed``) and the
        rest of the batch goes on."""
        t0 = time.perf_counter()
        try:
            ready = []  # (table, entry, L2 value or None when dropped, L3 backup or None)
            for (t, e), enc in zip(batch, self._encode_batch(batch)):
                if not isinstance(enc, Exception):
                    try:
                        ready.append((t, e, *self._frame(enc)))
                        continue
                    except Exception as exc:
                        enc = exc
                self.residency.swap_failed(t, e, enc)
            with self.offload.lock:
                backups = [(e, b) for _, e, _, b in ready if b is not None]
                if backups:
                    try:
                        self._put_backups(backups)
                    except Exception as exc:
                        for t, e, _, b in ready:
                            if b is not None:
                                self.residency.swap_failed(t, e, exc)
                        ready = [r for r in ready if r[3] is None]
                for t, e, value, _ in ready:
                    try:
                        self._put_l2(t, e, value)
                    except Exception as exc:
                        self.residency.swap_failed(t, e, exc)
        finally:
            self.residency.release_pending(batch)  # only what a bug left pending
            if batch:
                # one sample per block, as swap-in counts: the samples' total is the seconds spent
                self.counters.sample("swap_out", (time.perf_counter() - t0) / len(batch), len(batch))

    def _encode_batch(self, batch: list) -> list:
        """:meth:`_encode_slot` of each item, or the exception it raised."""
        def one(e):
            try:
                return self._encode_slot(e)
            except Exception as exc:
                return exc

        if self._side is None:
            return [one(e) for _, e in batch]
        # quantize on the side stream, copy the encodings into pinned host memory
        # asynchronously, wait once for the whole batch, then frame the records
        with torch.cuda.stream(self._side):
            encs = [one(e) for _, e in batch]
            self._side.synchronize()
        return encs

    def _frame(self, enc) -> tuple[bytes | None, bytes | None]:
        """The L2 value and the L3 backup record (None: none) of :meth:`_encode_slot`'s encodings
        (None: the block was dropped meanwhile)."""
        if enc is None:
            return None, None
        value = self.io.l2_record(pack_block(*enc[0]))
        return value, None if enc[1] is None else self.io.pack(pack_block(*enc[1]))

    def _put_l2(self, t: BlockTable, e, value: bytes | None) -> None:
        """Put one encoded block to L2 and settle its state (tier lock held)."""
        if value is None:  # dropped meanwhile
            self.residency.swapped_out(t, e, None, clean=False)
            return
        # another entry of the same content was copied below meanwhile (shared block, or its
        # write-through to L3): nothing to write
        clean = self.residency.is_clean(e)
        if clean or self.offload.l2.put(e.rec.key, value):
            self.residency.swapped_out(t, e, None if clean else len(value), clean)
        else:
            self.counters.add(evict_failed=1)
            self.residency.swapped_out(t, e, None, clean=False)

    def _put_backups(self, backups: list) -> None:
        """Put the base-codec backups of blocks stored below it to L3 (tier lock held). A refused
        one is just not there: the block then has its low copy only, and is never upgraded."""
        todo = [(e, value) for e, value in backups if self.copies.needs_l3(e.rec)]
        oks = self.offload.put_l3([(e.rec.key, value) for e, value in todo]) if todo else []
        stale = []
        for (e, value), ok in zip(todo, oks):
            if not ok:
                self.counters.add(precision_backup_failed=1)
            elif self.copies.landed_l3(e.rec, len(value), written_through=True):
                self.counters.add(precision_backups=1, swap_out_l3_bytes=len(value))
            else:
                stale.append(e.rec.key)  # dropped while being written
        if stale:
            self.offload.l3.delete_many(stale)

    def _encode_slot(self, e):
        """The (K, V) encodings of a pending block's slot for L2, and those of its base-codec
        backup for L3 (None when it needs none), on the host (pinned, copy in flight on CUDA)."""
        slot = self.residency.pending_slot(e)
        if slot is None:
            return None
        if e.fence is not None:
            self._side.wait_event(e.fence)
        block = self.l1.pool[slot]  # [2, kv_heads, block_tokens, head_dim]
        plan = self.layout.precision
        if plan is None:
            return self.io.encode_pair(block, "l2"), None
        codec = e.evict_codec or plan.base
        self.counters.add(**{f"precision_{codec}": 1})
        backup = None
        if plan.below_base(codec) and plan.recalls and self.offload.l3 is not None and self.copies.needs_l3(e.rec):
            backup = self.io.encode_pair(block, "l3")
        return self.io.encode_pair(block, "l2", codec), backup
