"""Write-through of content-addressed blocks to L3 (reuse after restart) and L4 (sharing across
processes): encoded in the disk format, batched, on the publisher thread off the decode path."""
from __future__ import annotations

import warnings

from .blockio import BlockIO
from .copies import CopyRecords
from .offload import OffloadTiers
from .stats import Counters
from .swap import SwapOutWorker
from .table import BlockCopies


class WriteThrough:
    def __init__(self, copies: CopyRecords, io: BlockIO, offload: OffloadTiers, counters: Counters,
                 batch_blocks: int) -> None:
        self.copies = copies
        self.io = io
        self.offload = offload
        self.counters = counters
        self.last_error: Exception | None = None  # the last encode or put that raised
        self._worker = SwapOutWorker(self._publish_batch, max(batch_blocks, 64), name="kvtier-publish")

    def submit(self, rec: BlockCopies, data) -> None:
        """Publish ``data`` [2, kv_heads, block_tokens, head_dim] (owned) as ``rec``."""
        self._worker.submit([(rec, data)])

    def drain(self) -> None:
        self._worker.drain()

    def wait(self) -> None:
        """Wait for the worker without raising its kept error (an undo after a failure)."""
        self._worker.wait()

    def close(self) -> None:
        self._worker.close()

    def _publish_batch(self, batch: list) -> None:
        """Encode and put a batch. Write-through is best effort (nobody waits for it, and a
        missing copy is a later miss), so a block whose encoding raises (NaN/Inf KV that no
        append check saw, on CUDA; any codec error) or a put that raises is not published:
        counted, kept in ``last_error`` and warned once, never raised into an unrelated call.
        The block's swap-out, if the codec refuses it too, is reported to its sequence's
        caller (evictor.py)."""
        todo = []
        for rec, data in batch:
            if self.copies.needs_publish(rec):
                try:
                    todo.append((rec, self.io.disk_record(data)))
                except Exception as exc:
                    self._failed(exc, pub_encode_failed=1)
        if todo and self.offload.l3 is not None:
            try:
                self._put_l3(todo)
            except Exception as exc:
                self._failed(exc, pub_l3_failed=len(todo))
        if todo and self.offload.l4 is not None:
            try:
                self._put_l4(todo)
            except Exception as exc:
                self._failed(exc, pub_l4_failed=len(todo))

    def _failed(self, exc: Exception, **counts) -> None:
        self.counters.add(**counts)
        if self.last_error is None:
            warnings.warn(f"kvtier: write-through to L3/L4 failed ({type(exc).__name__}: {exc}); the blocks "
                          f"concerned are not published (counted in stats()); later ones are tried",
                          RuntimeWarning, stacklevel=2)
        self.last_error = exc

    def _put_l3(self, todo: list) -> None:
        offload = self.offload
        with offload.lock:
            # a spill may have put some meanwhile
            put3 = [(r, p) for r, p in todo if self.copies.needs_l3(r)]
            oks = offload.offer_l3([(r.key, p) for r, p in put3]) if put3 else []
            stale = []
            for (rec, packed), ok in zip(put3, oks):
                if ok is None:
                    self.counters.add(pub_l3_not_admitted=1)
                elif not ok:
                    self.counters.add(pub_l3_failed=1)
                elif self.copies.landed_l3(rec, len(packed), written_through=True):
                    self.counters.add(pub_l3_blocks=1, pub_l3_bytes=len(packed))
                else:
                    stale.append(rec.key)  # dropped while being written
            if stale:
                offload.l3.delete_many(stale)

    def _put_l4(self, todo: list) -> None:
        put4 = [(r, p) for r, p in todo if not self.copies.flags(r)[2]]
        oks = self.offload.l4.put_many([(r.key, p) for r, p in put4])  # a dead server: all False
        for (rec, packed), ok in zip(put4, oks):
            if ok:
                self.copies.published_l4(rec)
                self.counters.add(pub_l4_blocks=1, pub_l4_bytes=len(packed))
            else:
                self.counters.add(pub_l4_failed=1)
