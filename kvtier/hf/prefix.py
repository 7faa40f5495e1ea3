"""Content-addressed keys for a TieredCache's blocks, and linking a prefix already stored.

A block is shared (by another conversation, a later process, another machine through L4) only
under a key made of the token ids that produced it, chained from the first token: the store
learns the ids of each forward as it appends (:meth:`KVStore.note_tokens`). A gap -- one forward
whose ids are unknown, or whose ids do not name its K/V (padding, shifted positions, inputs
beside text) -- would shift every later key, so from the first gap on the cache gives no more
ids and its blocks keep process-local keys.

```
 pre-hook: expect(input_ids) ──► layer-0 update: note(t, past) ──► store.note_tokens(seq, ids, salt)
 before a prefill: link(input_ids) ──► store.attach_prefix / match_prefix  (whole blocks, < T)
```
The ids come from a forward pre-hook that :func:`~kvtier.hf.cache.attach` registers, or from
:meth:`~kvtier.hf.cache.TieredCache.note_tokens`. A prefix is found wherever it was stored: by
another cache of the same store, an earlier process's L3 directory, or the L4 server:

```
 n = cache.load_prefix(ids)                    # tokens found, whole blocks, < len(ids)
 model.generate(ids, cache=cache)              # transformers feeds ids[:, n:] only
```
"""
from __future__ import annotations

import torch

from kvtier.store import KVStore

from .rows import BatchRows


class TokenKeys:
    """The token ids of one cache's rows, given to the store while they name its K/V.

    Args:
        shareable: the cache may share blocks at all (it knows its model's identity, and the
            model takes text only): otherwise nothing is noted and no prefix is linked.
        salt: the tenant of the cache's conversation (part of every key).
    """

    def __init__(self, store: KVStore, rows: BatchRows, salt: str, shareable: bool) -> None:
        self.store = store
        self.rows = rows
        self.salt = salt
        self.shareable = shareable
        self.ok = shareable  # False once a forward came without ids
        self.pending: torch.Tensor | None = None  # ids of the forward in flight, noted at layer 0

    def expect(self, input_ids: torch.Tensor | None) -> None:
        """The ids of the next forward ([batch, t]), or None where they do not name its K/V."""
        self.pending = input_ids

    def drop_pending(self) -> None:
        """The forward in flight was rolled back: its ids go with it."""
        self.pending = None

    def restart(self) -> None:
        """The rows are new (reset, or a rolled-back first forward): keys may be given again."""
        self.pending = None
        self.ok = self.shareable

    def note(self, t: int, past: int) -> None:
        """Note the ids of this forward, only while every earlier token's ids were noted (a gap
        would shift every later block's key): afterwards blocks keep process-local keys."""
        ids, self.pending = self.pending, None
        if not self.ok:
            return
        store = self.store
        if ids is None or ids.dim() != 2 or ids.shape != (len(self.rows), t) \
                or any(store.tokens_noted(seq) != past for seq in self.rows):
            self.ok = False
            return
        for row, seq in enumerate(self.rows.seqs):
            store.note_tokens(seq, ids[row], self.salt)

    def link(self, input_ids: torch.Tensor) -> int:
        """Link the longest stored prefix of every row of ``input_ids`` ([batch, T]) into the
        (empty) rows: the same number of tokens in each (the shortest match), whole blocks,
        fewer than T. Returns that number (0 for a cache that shares nothing)."""
        if not self.shareable:
            return 0
        store = self.store
        rows = input_ids[:, :-1].cpu()
        if not self.rows.seqs:
            self.rows.register(rows.shape[0])
        elif len(self.rows) != rows.shape[0]:
            raise ValueError(f"batch size must stay {len(self.rows)} for this cache; got {rows.shape[0]}")
        if len(self.rows) == 1:  # one row: attach reads as far as it finds (one pass, L4 batched)
            return store.attach_prefix(self.rows.seqs[0], rows[0], self.salt)
        n = min(store.match_prefix(r, self.salt) for r in rows)
        for _ in range(3):
            got = [store.attach_prefix(seq, r[:n], self.salt) for seq, r in zip(self.rows.seqs, rows)] if n else []
            if not got or min(got) == max(got) == n:
                return n
            # a block vanished between match and attach (L3 reclaimed it, the server evicted
            # it): cut every row to what every row got
            n = min(got)
            self.rows.truncate(n)
        raise RuntimeError("load_prefix: the stored prefix kept changing while being attached")
