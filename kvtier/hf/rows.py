"""Batch rows of a TieredCache: row ``b`` is store sequence ``seqs[b]``.

Every change of the batch is all or nothing: the room the new sequences need in L1 is made
(the store's pool grows on demand: :meth:`KVStore.reserve_sequences`) before any is registered,
and a failure half-way gives back what it took, so a refused ``batch_repeat_interleave`` (L1
cannot grow: MemoryError naming the bytes) leaves the store exactly as it was. A repeated row is a fork (:meth:`KVStore.fork_sequence`): it shares the
sealed blocks by reference count instead of copying the KV.
"""
from __future__ import annotations

from kvtier.store import KVStore


class BatchRows:
    """The store sequences of one cache, in batch order."""

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.seqs: list[int] = []
        self.forked = 0  # sequences made by repeating a row (beam search, num_return_sequences)

    def __len__(self) -> int:
        return len(self.seqs)

    def __iter__(self):
        return iter(self.seqs)

    def register(self, n: int) -> None:
        """Give an empty batch ``n`` new sequences (all or none)."""
        assert not self.seqs, "register() is for an empty batch"
        self.seqs = self.store.add_sequences(n)

    def rebatch(self, rows: list[int], method: str) -> None:
        """New batch whose row i is old row ``rows[i]``: repeats are forks, rows left out are dropped.

        Raises:
            ValueError (nothing changed) for an index out of range; MemoryError (nothing changed)
            when L1 cannot grow for the forks even with the room of the rows left out.
        """
        n = len(self.seqs)
        if not n:
            return
        if any(not 0 <= r < n for r in rows):
            raise ValueError(f"{method}: indices must be in [0, {n}); got {rows}")
        kept = set(rows)
        left_out = [r for r in range(n) if r not in kept]
        repeats = len(rows) - len(kept)
        # room for every fork before anything is dropped, so that a failure while forking undoes
        # the forks and leaves the batch as it was (the pool grows for the forks; the rows left
        # out give their room back once the forks exist). Only where L1 cannot grow (at
        # hot_max_bytes) do the forks take the room of the rows left out, which then go first:
        # a failure after that cannot bring them back, and the batch is emptied instead of
        # naming dropped sequences.
        dropped_first = False
        try:
            self.store.reserve_sequences(repeats)
        except MemoryError:
            self.store.reserve_sequences(max(0, repeats - len(left_out)))  # refuses with nothing changed
            if repeats > self.store.free_sequences():
                for r in left_out:
                    self.store.drop_sequence(self.seqs[r], keep_prefix=True)
                left_out, dropped_first = [], True
        seen: set[int] = set()
        new: list[int] = []
        forks: list[int] = []
        try:
            for r in rows:
                seq = self.seqs[r]
                if r in seen:
                    seq = self.store.fork_sequence(seq)
                    forks.append(seq)
                new.append(seq)
                seen.add(r)
        except BaseException:
            for seq in forks:
                self.store.drop_sequence(seq)
            if dropped_first:
                self.release()
            raise
        for r in left_out:
            self.store.drop_sequence(self.seqs[r], keep_prefix=True)
        self.seqs = new
        self.forked += len(forks)

    def fork_all(self) -> list[int]:
        """A fork of every row, in order (all or none)."""
        self.store.reserve_sequences(len(self.seqs))
        forks: list[int] = []
        try:
            for seq in self.seqs:
                forks.append(self.store.fork_sequence(seq))
        except BaseException:
            for seq in forks:
                self.store.drop_sequence(seq)
            raise
        return forks

    def truncate(self, length: int) -> None:
        """Every row, every layer cut back to ``length`` tokens."""
        for seq in self.seqs:
            self.store.truncate_sequence(seq, length)

    def release(self) -> None:
        """Give every sequence back to the store (their content-addressed L3 copies stay for
        later prefix matches). Safe on a closed store: it forgot them already."""
        seqs, self.seqs = self.seqs, []
        if self.store.closed:
            return
        for seq in seqs:
            self.store.drop_sequence(seq, keep_prefix=True)
