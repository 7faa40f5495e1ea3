"""The disk tier's locks, shared by its parts (one object, handed to each part that takes one).

Taken in this order, never the reverse:

  checkpoint (one index checkpoint at a time) | sync (one batch of fdatasyncs at a time)
    -> write (one appender: puts, tombstones, compaction copies, sealing or closing files)
      -> tier (the index, the segment set and file state; every get)

``tier`` guards the state of ``Catalog`` (the index), ``SegmentFiles`` (segments, head, dirty
set, mapped set) and the counters; ``write`` makes one part at a time append to the head
(``Appender``), so a reservation made under ``tier`` still holds when it is published. A part
reads ``locks.tier`` / ``locks.write`` each time it takes them (never a copy kept in its own
attributes), so one replacement here (a timing or counting wrapper) reaches every part.

``appenders`` counts the appenders under way (a put_many, delete_many, sync or compactor step):
while there is one, reads keep the GIL through their system calls (``holding_gil``).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class WriteLock:
    """The appenders' lock (re-entrant), counting how deep its owner holds it (``held``).

    Reads keep the GIL through their system calls while an appender is under way (see
    ``Locks.at_work``), except while one holds this lock: a put waiting for it waits for the
    holder, so the holder must get the GIL back as soon as it can, not only when a read's
    thread is made to give it up (the switch interval)."""

    __slots__ = ("_lock", "held")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.held = 0  # (changed only by the owner)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock.acquire(blocking, timeout):
            return False
        self.held += 1
        return True

    def release(self) -> None:
        self.held -= 1
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _is_owned(self) -> bool:
        return self._lock._is_owned()


class Locks:
    """The locks of one disk tier, in the order above, and its appenders under way."""

    def __init__(self) -> None:
        self.tier = threading.RLock()
        # ``writing``: the WriteLock itself, which reads ask whether it is held, even while
        # ``write`` is wrapped by something that is not a WriteLock
        self.write = self.writing = WriteLock()
        self.checkpoint = threading.Lock()
        self.sync = threading.Lock()
        self.appenders: list[None] = []  # one entry per appender under way (``at_work``)

    @contextlib.contextmanager
    def appending(self) -> Iterator[None]:
        """Both locks an append needs, in their order."""
        with self.write, self.tier:
            yield

    @contextlib.contextmanager
    def at_work(self) -> Iterator[None]:
        """Counts an appender under way (a put_many, delete_many, sync or compactor step) from its
        first lock to its last sync: meanwhile reads keep the GIL through their system calls
        (``holding_gil``), which the appender would otherwise take at each one and keep for
        its Python until its next system call. (A list's append and pop are atomic: no lock.)"""
        self.appenders.append(None)
        try:
            yield
        finally:
            self.appenders.pop()

    def holding_gil(self) -> bool:
        """Whether a read should keep the GIL through its system calls now: an appender is under
        way and none holds the write lock (``WriteLock``)."""
        return bool(self.appenders) and not self.writing.held
