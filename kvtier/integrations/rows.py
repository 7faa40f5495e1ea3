"""Batch rows of a TieredCache: row ``b`` is store sequence ``seqs[b]``.

Every change of the batch is all or nothing: the sequences a change needs are counted against
``max_sequences`` before any is registered, and a failure half-way gives back what it took, so
a refused ``batch_repeat_interleave`` (or a first batch larger than the store allows) leaves the
store exactly as it was. A repeated row is a fork (:meth:`KVStore.fork_sequence`): it shares the
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
            ValueError (nothing changed) for an index out of range or too few free sequences.
        """
        n = len(self.seqs)
        if not n:
            return
        if any(not 0 <= r < n for r in rows):
            raise ValueError(f"{method}: indices must be in [0, {n}); got {rows}")
        repeats = len(rows) - len(set(rows))
        free = self.store.free_sequences()
        if repeats > free:
            raise ValueError(
                f"{method}: the new batch of {len(rows)} rows needs {repeats} more store sequences and "
                f"only {free} are free (max_sequences={self.store.cfg.max_sequences}); raise "
                f"KVTierConfig.max_sequences to at least batch x beams (x num_return_sequences)")
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
            raise
        for r in range(n):
            if r not in seen:
                self.store.drop_sequence(self.seqs[r], keep_prefix=True)
        self.seqs = new
        self.forked += len(forks)

    def fork_all(self) -> list[int]:
        """A fork of every row, in order (all or none)."""
        if len(self.seqs) > self.store.free_sequences():
            raise ValueError(
                f"fork: {len(self.seqs)} rows need as many free store sequences and only "
                f"{self.store.free_sequences()} are free (max_sequences={self.store.cfg.max_sequences}); "
                f"raise KVTierConfig.max_sequences or close caches you no longer use")
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
