"""Append: tokens written in place into the open block's L1 slot; a full block is sealed (key
digest, content key) when the next one opens.

Only a table's own caller writes its open block, and the worker never reads an open block, so
the token data is written without the state lock (only under the pool lock, which keeps the
pool from growing under the write); the bookkeeping goes through ``Residency``.

An append is all or nothing: one that opens blocks and fails on the way (no room in any tier)
is undone, so the table holds what it held before:

```
 before   [ b0 ][ b1 open: f tokens ]            saved: a copy of b1's slot
 failing  [ b0 ][ b1 sealed ][ b2 ][ b3 open ] -> no room for b4: raise
 undone   [ b0 ][ b1 open: f tokens ]            b2, b3 dropped; b1 reopened (from the copy
                                                 if it was evicted meanwhile: no lossy decode)
```
"""
from __future__ import annotations

import torch

from .content import ContentIndex
from .evictor import Evictor
from .layout import Layout
from .residency import Residency
from .surgery import SequenceSurgery
from .table import BlockTable


class Appender:
    def __init__(self, layout: Layout, residency: Residency, evictor: Evictor, content: ContentIndex | None,
                 surgery: SequenceSurgery) -> None:
        self.layout = layout
        self.residency = residency
        self.evictor = evictor
        self.content = content  # None without a fingerprint: no content keys
        self.surgery = surgery

    def append(self, t: BlockTable, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [kv_heads, n, head_dim] on the store's device and dtype, n >= 1."""
        with self.residency.pool_lock:  # the pool does not move (grow) while the slot is written
            self._append(t, k, v)

    def _append(self, t: BlockTable, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[1]
        bt = self.layout.block_tokens
        ents = t.entries
        if ents:
            fill = t.length - (len(ents) - 1) * bt
            if fill + n <= bt:
                self._write_open(t, fill, k, v)  # decode: the tokens fit in the open block
                self.residency.appended(t, ents[-1], t.length + n)
                return
        start = t.length
        # the open block's data as it is: it may be sealed, evicted and stored lossy on the way
        saved = t.open_view.clone() if ents else None  # [2, kv_heads, block_tokens, head_dim]
        try:
            self._append_blocks(t, k, v)
        except BaseException:
            # nothing of this table in flight while it is cut back
            self.evictor.wait()
            if self.content is not None and self.content.publisher is not None:
                self.content.publisher.wait()
            self.surgery.cut(t, start, saved)
            raise

    def _append_blocks(self, t: BlockTable, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [kv_heads, n, head_dim] from the open block on, opening blocks as needed."""
        n = k.shape[1]
        bt = self.layout.block_tokens
        pool = self.residency.l1.pool
        pos = t.length
        off = 0
        while off < n:
            fill = pos - (len(t.entries) - 1) * bt if t.entries else bt
            if fill == bt:
                if t.entries:
                    self._seal(t)
                self._open_block(t)
                fill = 0
            take = min(bt - fill, n - off)
            slot = t.entries[-1].slot
            pool[slot, 0, :, fill:fill + take] = k[:, off:off + take]  # [kv_heads, take, head_dim]
            pool[slot, 1, :, fill:fill + take] = v[:, off:off + take]
            off += take
            pos += take
        self.residency.appended(t, t.entries[-1], pos)

    def _write_open(self, t: BlockTable, fill: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [kv_heads, n, head_dim] at token ``fill`` of the open block."""
        n = k.shape[1]
        o = t.open_np  # [2, kv_heads, block_tokens, head_dim] aliasing the slot (CPU)
        if o is not None and not k.requires_grad and not v.requires_grad:
            # CPU: two numpy slice assignments cost about half of the torch stack + copy
            as_np = self.residency.np_view
            if as_np is None:
                o[0, :, fill:fill + n] = k.numpy()
                o[1, :, fill:fill + n] = v.numpy()
            else:  # 16-bit floats as int16 (numpy has no bfloat16): a bit copy
                o[0, :, fill:fill + n] = k.view(as_np).numpy()
                o[1, :, fill:fill + n] = v.view(as_np).numpy()
        else:
            t.open_view.narrow(2, fill, n).copy_(torch.stack((k, v)))  # [2, kv_heads, n, head_dim]

    def _seal(self, t: BlockTable) -> None:
        e = t.entries[-1]
        self.residency.seal(t, e)
        if self.content is not None:
            self.content.assign(t, e)

    def _open_block(self, t: BlockTable) -> None:
        e = self.residency.new_block(t)
        try:
            self.evictor.make_room(t, 1)
        except BaseException:  # no room (every tier full): leave no half-opened block behind
            self.residency.abandon_block(t, e)
            raise
        self.residency.place_open(t, e)
