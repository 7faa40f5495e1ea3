"""A background worker thread that processes submitted items in batches.

The store runs two: swap-out (``evictor.py``: (table, entry) items, encoded and put to L2 off
the decode path) and write-through (``writethrough.py``). Each is one thread that takes at most
``batch`` items at a time. ``drain`` waits until everything submitted was processed: the decode
path calls it only when L1 is truly full.

The process function settles each item itself, failures included (the swap-out of a block whose
encoding or put raises keeps it in L1 and reports a :class:`SwapOutError` to its sequence's
caller: ``evictor.py``). An exception that escapes it is a bug of the store: it is kept and
raised by the next ``drain``/``submit`` so it is never silently lost.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable


class SwapOutError(RuntimeError):
    """The swap-out of one block failed: the codec or a tier put raised ``__cause__``.

    The block stays resident in L1 at full precision and is not evicted again; nothing else
    changed. Raised once, by the next store call on the sequence (dropping or truncating the
    sequence frees the block)."""

    def __init__(self, seq: int, layer: int, block: int, cause: BaseException) -> None:
        super().__init__(
            f"kvtier: swap-out of block {block} of sequence {seq} layer {layer} failed "
            f"({type(cause).__name__}: {cause}); the block stays in L1 at full precision and is "
            f"not evicted again (drop or truncate the sequence to free it)")
        self.seq, self.layer, self.block = seq, layer, block
        self.__cause__ = cause


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
        """Block until every submitted item was processed; then raise a kept worker error."""
        self.wait()
        self._raise_pending_error()

    def wait(self) -> None:
        """Block until every submitted item was processed (a kept error stays kept)."""
        with self._cv:
            self._cv.wait_for(lambda: (not self._q and not self._busy) or not self._thread.is_alive())

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
            except BaseException as e:  # a bug: kept for the next drain/submit
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
