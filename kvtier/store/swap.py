"""A background worker thread that processes submitted items in batches.

The store runs two: swap-out (``evictor.py``: (table, entry) items, encoded and put to L2 off
the decode path) and write-through (``writethrough.py``). Each is one thread that takes at most
``batch`` items at a time. ``drain`` waits until everything submitted was processed: the decode
path calls it only when L1 is truly full. An exception in the worker is kept and raised by the
next ``drain``/``submit`` so it is never silently lost.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable


class SwapOutWorker:
    def __init__(self, process: Callable[[list], None], batch: int, name: str = "kvtier-swapout") -> None:
        self._process = process
        self._batch = batch
        self._q: deque = deque()
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("kvtier swap-out worker failed") from err

    def submit(self, items: list) -> None:
        if not items:
            return
        with self._cv:
            if self._closed:
                raise RuntimeError("kvtier swap-out worker is closed")
            self._q.extend(items)
            self._cv.notify()
        self._raise_pending_error()

    def drain(self) -> None:
        """Block until every submitted item was processed."""
        with self._cv:
            self._cv.wait_for(lambda: (not self._q and not self._busy) or not self._thread.is_alive())
        self._raise_pending_error()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._q or self._closed)
                if not self._q:
                    return
                n = min(self._batch, len(self._q))
                batch = [self._q.popleft() for _ in range(n)]
                self._busy = True
            try:
                self._process(batch)
            except BaseException as e:  # kept for the caller's next drain/submit
                self._error = e
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()
        self._raise_pending_error()
