"""The records of the copies below L1 (L2, L3, L4), by tier key, and what they add up to.

A :class:`~kvtier.store.table.BlockCopies` record is shared by every entry holding the same
content (table.py); this part keeps the live ones (those some entry references), the copies and
bytes they hold in L2 and L3 (``below``, for ``stats()`` in O(1)), the keys just read from L4
and which tiers content records are written through to. It has no lock of its own: its state is
guarded by the state lock (``Residency.lock``, handed in), as docs/architecture.md's lock order
says. Methods that say "lock held" are called by Residency or SequenceSurgery with that lock
taken; every other method takes it itself.

A mapping (read-only) of tier key to record, so tests and tools can look inside.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

from .stats import Counters
from .table import BlockCopies, BlockEntry


def _zero_below() -> dict:
    return dict(copies_l2=0, copies_l3=0, bytes_l2=0, bytes_l3=0)


def add_below(out: dict, rec: BlockCopies) -> None:
    """Add ``rec``'s L2 and L3 copies and their bytes to ``out`` (``copies_l2``, ``bytes_l2``,
    ``copies_l3``, ``bytes_l3``)."""
    if rec.l2:
        out["copies_l2"] += 1
        out["bytes_l2"] += rec.l2_bytes
    if rec.l3:
        out["copies_l3"] += 1
        out["bytes_l3"] += rec.l3_bytes


class CopyRecords(Mapping):
    def __init__(self, lock: threading.Lock, counters: Counters) -> None:
        self.lock = lock  # the state lock, owned by Residency
        self.counters = counters
        self._records: dict[str, BlockCopies] = {}  # tier key -> live record (refcounted)
        self.below = _zero_below()                 # copies and bytes in L2 and L3 of the live records
        self.known_l4: set[str] = set()            # keys just read from L4 (no need to publish)
        # (L3, L4) content records are written through to; None: no write-through
        self.publish_to: tuple[bool, bool] | None = None

    # -- the mapping (reads without the lock: for tests and tools on a quiet store) -------------

    def __getitem__(self, key: str) -> BlockCopies:
        return self._records[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    # -- lifetime (lock held) ----------------------------------------------------------------

    def add(self, rec: BlockCopies) -> None:
        """``rec`` is live under its key (lock held)."""
        self._records[rec.key] = rec

    def forget(self, rec: BlockCopies) -> None:
        """``rec`` is no longer live; a newer record under its key stays (lock held)."""
        if self._records.get(rec.key) is rec:
            del self._records[rec.key]

    def release(self, e: BlockEntry, drop2: list, drop3: list, keep_content: bool) -> None:
        """Drop ``e``'s reference to its record; the last one forgets the record and lists its
        L2 and L3 keys in ``drop2``/``drop3`` for the caller to delete (an L3 copy of a
        content-addressed record stays when ``keep_content``: for later prefix matches). Lock
        held."""
        rec = e.rec
        rec.entries.remove(e)
        if rec.entries:
            return
        self.forget(rec)
        if rec.l2:
            drop2.append(rec.key)
        if rec.l3 and not (keep_content and rec.content):
            drop3.append(rec.key)

    def join(self, key: str, adopt_bytes: int | None) -> tuple[BlockCopies, bool]:
        """The content-addressed record ``key``: the live one (dedup), or a new one adopting an
        L3 copy of ``adopt_bytes`` left by an earlier process. Returns it and whether it is new
        (lock held)."""
        rec = self._records.get(key)
        new = rec is None
        if new:
            rec = self._records[key] = BlockCopies(key, content=True)
            rec.l4 = key in self.known_l4
            if adopt_bytes is not None:
                rec.l3 = rec.written_through = True
                rec.l3_bytes = adopt_bytes
                self.below["copies_l3"] += 1
                self.below["bytes_l3"] += adopt_bytes
                self.counters.add(adopted_l3=1)
        else:
            self.counters.add(dedup_seals=1)
        self.known_l4.discard(key)
        return rec, new

    def landed_l2(self, rec: BlockCopies, nbytes: int, codec: str | None) -> None:
        """The swap-out worker put an L2 copy of ``rec`` (``nbytes``, encoded in ``codec``; lock
        held)."""
        rec.l2 = True
        rec.l2_bytes = nbytes
        rec.l2_codec = codec
        rec.upgrade = False
        self.below["copies_l2"] += 1
        self.below["bytes_l2"] += nbytes

    def left_l2(self, rec: BlockCopies) -> None:
        """The ring dropped ``rec``'s L2 copy (lock held)."""
        rec.l2 = False
        self.below["copies_l2"] -= 1
        self.below["bytes_l2"] -= rec.l2_bytes
        rec.l2_bytes = 0
        rec.l2_codec = None
        rec.upgrade = False

    def lacks(self, rec: BlockCopies) -> bool:
        """Whether ``rec`` lacks a copy in a tier it is written through to (lock held)."""
        to3, to4 = self.publish_to or (False, False)
        return (to3 and not rec.l3) or (to4 and not rec.l4)

    def counted(self) -> dict:
        """``below`` as the live records add it up (lock held)."""
        out = _zero_below()
        for r in self._records.values():
            add_below(out, r)
        return out

    # -- the tiers' side (each takes the lock) ---------------------------------------------------

    def recount(self) -> None:
        """Copies and bytes below L1 from the live records (after tier deletes)."""
        with self.lock:
            self.below = self.counted()

    def flags(self, rec: BlockCopies) -> tuple[bool, bool, bool, str]:
        with self.lock:
            return rec.l2, rec.l3, rec.l4, rec.key

    def read_states(self, recs: list[BlockCopies]) -> list[tuple[bool, bool, bool, bool, str]]:
        """Per record of a swap-in batch, under one hold of the lock: (upgrade due, l2, l3, l4,
        key). An upgrade is due when the record was found heavy while L2 holds it below the base
        codec and L3 holds its base-codec copy: the caller then drops the L2 copy (tier lock held)
        and calls ``Residency.spilled``. A mark without an L3 copy to read is cleared."""
        with self.lock:
            return [(_upgrade_due(rec), rec.l2, rec.l3, rec.l4, rec.key) for rec in recs]

    def l2_reads(self, recs: list[BlockCopies]) -> list[tuple[str | None, int]]:
        """Per record, under one hold of the lock: (its tier key when L2 holds its copy and no
        upgrade is due, else None; its generation, as :meth:`generations`). An upgrade mark
        without an L3 copy is cleared, as :meth:`read_states` does."""
        with self.lock:
            return [(rec.key if rec.l2 and not _upgrade_due(rec) else None, rec.marks) for rec in recs]

    def generations(self, recs: list[BlockCopies]) -> list[int]:
        """How many times each of ``recs`` was marked for upgrade: data decoded from its copies
        below L1 at an older generation may be of the low copy an upgrade replaces."""
        with self.lock:
            return [rec.marks for rec in recs]

    def record_of(self, key: str) -> BlockCopies | None:
        with self.lock:
            return self._records.get(key)

    def landed_l3(self, rec: BlockCopies, nbytes: int, written_through: bool) -> bool:
        """An L3 copy of ``rec`` landed (a spill, or a write-through). False, changing nothing,
        when ``rec`` was dropped meanwhile (the caller deletes the copy)."""
        with self.lock:
            if self._records.get(rec.key) is not rec:
                return False
            rec.l3 = True
            rec.written_through = written_through
            rec.l3_bytes = nbytes
            self.below["copies_l3"] += 1
            self.below["bytes_l3"] += nbytes
            return True

    def upgrade_failed(self, rec: BlockCopies) -> None:
        """``rec``'s backup could not be read: its low L2 copy stays its copy, unmarked."""
        with self.lock:
            rec.upgrade = False

    def published_l4(self, rec: BlockCopies) -> None:
        with self.lock:
            rec.l4 = True

    def referenced(self, keys: list[str]) -> list[bool]:
        """Per key, whether a live block record holds it."""
        with self.lock:
            return [k in self._records for k in keys]

    def unreferenced(self, keys) -> list[str]:
        with self.lock:
            return [k for k in keys if k not in self._records]

    def needs_publish(self, rec: BlockCopies) -> bool:
        with self.lock:
            return self._records.get(rec.key) is rec and self.lacks(rec)

    def needs_l3(self, rec: BlockCopies) -> bool:
        """Live and without an L3 copy (a spill may have put one meanwhile)."""
        with self.lock:
            return self._records.get(rec.key) is rec and not rec.l3

    def available(self, key: str) -> bool:
        with self.lock:
            rec = self._records.get(key)
            return rec is not None and bool(rec.entries or rec.l2 or rec.l3 or rec.l4)

    def note_l4(self, keys) -> None:
        with self.lock:
            self.known_l4.update(keys)


def _upgrade_due(rec: BlockCopies) -> bool:
    """Whether ``rec``'s upgrade is due (a mark, and both an L2 and an L3 copy); a mark without
    both is cleared (lock held)."""
    if rec.upgrade and not (rec.l2 and rec.l3):
        rec.upgrade = False
    return rec.upgrade
