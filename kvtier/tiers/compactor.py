"""DiskTier's background worker: compaction and index checkpoints off the put/get path.

Compaction copies a sealed segment's live records to the head in steps of ``step_bytes`` of
the segment, each step under the tier lock (so a put or get waits at most one step), and
sleeps between steps so that its I/O takes at most ``share`` of the time while it runs:
after a step of ``t`` seconds it sleeps ``t * (1 - share) / share``.

The worker owns no tier state: each step is a call back into the tier (``_background_step``),
which says whether there is more to do.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from .segfile import SEG_HEADER_BYTES, Segment

log = logging.getLogger(__name__)


@dataclass
class CompactJob:
    """One segment being compacted: the records before ``pos`` have been copied (or dropped)."""

    seg: Segment
    pos: int = SEG_HEADER_BYTES
    copied_bytes: int = 0
    sync_pending: bool = False  # every record moved; the copies must be durable before the unlink


class Compactor:
    """A daemon thread that calls ``step()`` while it returns True, paced to an I/O share."""

    def __init__(self, step, share: float, name: str) -> None:
        assert 0.0 < share <= 1.0, f"share {share} must be in (0, 1]"
        self._step, self.share = step, share
        self._cv = threading.Condition()
        self._wake = False
        self._stop = False
        self.busy_s = 0.0  # seconds spent in steps
        self.steps = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        with self._cv:
            self._wake = True
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._wake and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                self._wake = False
            while True:
                t0 = time.perf_counter()
                try:
                    more = self._step()
                except Exception as exc:  # a failed step (e.g. a full disk) leaves the tier as it was
                    self.error = exc
                    log.warning("kvtier DiskTier background compaction stopped: %r", exc)
                    more = False
                dt = time.perf_counter() - t0
                self.busy_s += dt
                self.steps += 1
                if not more:
                    break
                with self._cv:
                    if self._cv.wait_for(lambda: self._stop, timeout=dt * (1.0 - self.share) / self.share):
                        return
