"""Eviction policies: which L1 blocks of one (sequence, layer) leave first.

A policy only orders blocks; the store applies watermarks, batching and the swap. Every policy
sees the sealed, resident, not-already-leaving blocks of one table and returns them in eviction
order (first = leaves first). Ties always break towards the older block, so orders are exact.

Protected blocks (never offered unless nothing else is left):
  lru          none
  sink-window  the sink blocks and the recent window (StreamingLLM keeps exactly these)
  h2o          sinks + recent window; the rest ordered by accumulated attention mass (H2O)
  snapkv       sinks + recent window; the rest by importance observed at the end of prefill
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from .table import BlockEntry, BlockTable


class EvictionPolicy(ABC):
    name = ""

    def __init__(self, sink_blocks: int = 0, window_blocks: int = 0) -> None:
        self.sink_blocks = sink_blocks
        self.window_blocks = window_blocks

    def protected(self, table: BlockTable) -> range | tuple:
        """Block indices kept in L1 while others can go: sinks and the recent sealed window."""
        n = table.n_sealed
        return _ProtectedSet(min(self.sink_blocks, n), max(0, n - self.window_blocks), n)

    @abstractmethod
    def sort_key(self, e: BlockEntry):
        """Smaller leaves first."""

    def victims(self, table: BlockTable, n: int, exclude=frozenset(), only_clean: bool = False,
                force: bool = False, ordered: bool = True) -> list[int]:
        """Up to ``n`` block indices to evict, in order.

        Args:
            n: how many are wanted.
            exclude: block indices that must stay (e.g. the current selection).
            only_clean: offer only blocks with a valid copy below L1 (they leave without a write).
            force: L1 is truly full: protected blocks go too (least recently used first) when
                nothing else is left. Watermark eviction never forces.
            ordered: False when the caller frees every block returned at once: if no more than
                ``n`` are offered they are returned unsorted (on a sparse step that fills L1
                they are the blocks the selection left, all of which go).
        """
        if n <= 0:
            return []
        prot = self.protected(table)
        if isinstance(prot, _ProtectedSet):  # inlined below: a method call per block costs more
            sink, start, end = prot.sink, prot.start, prot.n
            prot = ()
        else:
            sink = start = end = 0
        cand, fallback = [], []
        open_idx = len(table.entries) - 1  # the open block never leaves
        # resident blocks only (a table holds many more below L1); the sorts below make the
        # order independent of the scan order
        for e in table.slotted.values():
            b = e.idx
            if b == open_idx or e.pending or e.held or b in exclude or (only_clean and not e.clean):
                continue
            (fallback if b < sink or start <= b < end or b in prot else cand).append(e)
        if ordered or len(cand) > n:
            cand.sort(key=self.sort_key)
        out = [e.idx for e in cand[:n]]
        if force and len(out) < n and fallback:
            # Only when L1 is truly full of protected blocks: recency decides among them.
            fallback.sort(key=lambda e: (e.last_used, e.idx))
            out += [e.idx for e in fallback[: n - len(out)]]
        return out


class _ProtectedSet:
    """[0, sink) U [window_start, n) without building a set per call."""

    __slots__ = ("sink", "start", "n")

    def __init__(self, sink: int, start: int, n: int) -> None:
        self.sink, self.start, self.n = sink, start, n

    def __contains__(self, b: int) -> bool:
        return b < self.sink or self.start <= b < self.n


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def protected(self, table: BlockTable):
        return ()

    def sort_key(self, e: BlockEntry):
        return (e.last_used, e.idx)


class SinkWindowPolicy(EvictionPolicy):
    """StreamingLLM: everything between the sinks and the recent window goes, oldest first."""

    name = "sink-window"

    def sort_key(self, e: BlockEntry):
        return e.idx


class H2OPolicy(EvictionPolicy):
    """Heavy hitters stay: the block with the least accumulated attention mass goes first."""

    name = "h2o"

    def sort_key(self, e: BlockEntry):
        return (e.mass, e.idx)


class SnapKVPolicy(EvictionPolicy):
    """Importance voted by the observation window at the end of prefill; frozen afterwards."""

    name = "snapkv"

    def sort_key(self, e: BlockEntry):
        return (e.importance, e.idx)


POLICIES = {p.name: p for p in (LRUPolicy, SinkWindowPolicy, H2OPolicy, SnapKVPolicy)}


def make_policy(name: str, sink_blocks: int, window_blocks: int) -> EvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(map(repr, POLICIES))}; got {name!r}")
    return POLICIES[name](sink_blocks, window_blocks)
