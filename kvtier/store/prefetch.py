"""The prefetcher: non-resident blocks a predictor expects decoded in the background.

Predictors (sources): ``temporal`` (what a layer attended last step), ``next_layer`` (adjacent
layers attend to similar blocks), ``dense_next_layer`` / ``dense_next_step`` (dense reads stream
layer by layer). Wrong prefetches cost decode work and bandwidth: a source whose precision over
its last outcomes is below a floor is cut down to one probe in ``_PROBE``.

``scratch`` is no predictor and issues no work: a block a read swapped into a scratch slot (its
table's region full of blocks still being written out) leaves L1 when that read ends, and the
next step attends it again, so its decoded data is kept (oldest out, within ``buffer_blocks``)
and that read is a copy instead of a tier read and a decode. It works with prefetch off.

Kept blocks and prefetches carry the generation of their record when they were read
(``Residency.generation``: bumped when ``precision="importance"`` marks a low copy for
upgrade); one of an older generation than the record's now may hold the low copy's decode and
is dropped, so the next read decodes the upgraded copy.

Its lock guards the buffer of futures, the kept blocks, the predictor state and the outcome
statistics; it is never held while waiting.
"""
from __future__ import annotations

import threading
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from .offload import OffloadTiers
from .stats import Counters
from .table import BlockEntry, BlockTable

SOURCES = ("temporal", "next_layer", "dense_next_layer", "dense_next_step", "scratch")
_WINDOW = 128          # outcomes (used / wasted) remembered per predictor
_MIN_PRECISION = 0.25  # below this a predictor only probes ...
_PROBE = 8             # ... one block in this many
_BATCH = 16            # blocks per background load (one tier read; a fetch of one waits for all)


class Fetched(NamedTuple):
    """A non-resident block's data as :meth:`Prefetcher.fetch` hands it over."""

    data: torch.Tensor  # [2, kv_heads, block_tokens, head_dim], owned by the caller
    generation: int     # of the record when its copy was read (``Residency.generation``)


class Prefetcher:
    def __init__(self, offload: OffloadTiers, counters: Counters, buffer_blocks: int, enabled: bool) -> None:
        self.offload = offload
        self.counters = counters
        self.enabled = enabled
        self._buffer_blocks = buffer_blocks
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-prefetch") if enabled else None
        self._lock = threading.Lock()
        self._futures: OrderedDict[str, Future] = OrderedDict()  # process-local key -> load
        # process-local key -> a scratch read's block (its decoded data and generation)
        self._kept: OrderedDict[str, Fetched] = OrderedDict()
        self._outcomes = {src: deque(maxlen=_WINDOW) for src in SOURCES}
        self._skipped = dict.fromkeys(SOURCES, 0)
        self._by_source = {src: {"issued": 0, "used": 0, "wasted": 0, "throttled": 0} for src in SOURCES}
        self._last_sel: dict[tuple[int, int], list[int]] = {}
        self._dense_seqs: set[int] = set()

    # -- what the reads tell it ----------------------------------------------------------------

    def selected(self, tables: list[BlockTable], layer: int, sel: list[int]) -> None:
        """``select`` chose ``sel`` for ``layer``: remembered for next step, and the next layer's
        copies of those blocks are fetched now."""
        if self._pool is None:
            return
        with self._lock:
            self._last_sel[(tables[0].seq, layer)] = sel
        if layer + 1 < len(tables):
            self.prefetch(tables[layer + 1], sel, "next_layer")

    def dense_read(self, tables: list[BlockTable], layer: int, n: int) -> None:
        """A dense read of ``layer``: the next layer's missing blocks decode while it computes."""
        if self._pool is None:
            return
        if layer + 1 < len(tables):
            self.prefetch(tables[layer + 1], range(n), "dense_next_layer")
        with self._lock:
            self._dense_seqs.add(tables[0].seq)

    def end_step(self, tables_of) -> None:
        """Step boundary: prefetch what each layer attended last step and, for dense sequences,
        layer 0 again. ``tables_of(seq)``: the tables of a live sequence, None otherwise."""
        if self._pool is None:
            return
        with self._lock:
            last = list(self._last_sel.items())
            dense = list(self._dense_seqs)
            self._dense_seqs.clear()
        for (seq, layer), sel in last:
            tables = tables_of(seq)
            if tables is not None:
                self.prefetch(tables[layer], sel, "temporal")
        for seq in dense:
            tables = tables_of(seq)
            if tables is not None:
                self.prefetch(tables[0], range(len(tables[0].entries)), "dense_next_step")

    # -- the buffer ----------------------------------------------------------------------------

    def prefetch(self, t: BlockTable, blocks, src: str) -> None:
        """Decode the non-resident ``blocks`` of ``t`` in the background (predictor ``src``), in
        batches of ``_BATCH`` (one tier read each)."""
        ents = t.entries
        n = len(ents) - 1
        dropped, issued = [], []
        with self._lock:
            for b in blocks:
                if b >= n:
                    continue
                e = ents[b]
                if e.slot is not None or e.key in self._futures:
                    continue
                if not self._allowed(src):
                    self._by_source[src]["throttled"] += 1
                    continue
                while len(self._futures) >= self._buffer_blocks:
                    dropped.append(self._futures.popitem(last=False)[1])
                fut = Future()
                fut.kvtier_source = src
                self._futures[e.key] = fut
                issued.append((e, fut))
            for i in range(0, len(issued), _BATCH):
                self._pool.submit(self._load_into, issued[i:i + _BATCH])
            self._by_source[src]["issued"] += len(issued)
        if issued:
            self.counters.add(pf_issued=len(issued))
        for old in dropped:
            self._discard(old)

    def _load_into(self, batch: list[tuple[BlockEntry, Future]]) -> None:
        """The worker's job: load the blocks of ``batch`` whose futures were not cancelled
        meanwhile, together, into their futures. A failing batch is loaded again block by
        block, so one unreadable block fails only its own future."""
        live = [(e, fut) for e, fut in batch if fut.set_running_or_notify_cancel()]
        if not live:
            return
        try:
            got = [_owned(f) for f in self._load([e for e, _ in live])]
        except Exception:
            got = None
        for i, (e, fut) in enumerate(live):
            try:
                fut.set_result(got[i] if got is not None else self._load([e])[0])
            except Exception as exc:  # the fetch that takes it reads the block synchronously
                fut.set_exception(exc)

    def _allowed(self, src: str) -> bool:
        """Whether predictor ``src`` may issue now (lock held)."""
        out = self._outcomes[src]
        if len(out) < _WINDOW // 2 or sum(out) >= _MIN_PRECISION * len(out):
            return True
        self._skipped[src] += 1
        return self._skipped[src] % _PROBE == 0  # keep measuring it

    def keep(self, e: BlockEntry, got: Fetched) -> None:
        """``got`` (``e`` as :meth:`fetch` returned it; its data owned: nobody writes it) went
        to a scratch slot: hold it for the next read of ``e`` (the ``scratch`` source)."""
        stats = self._by_source["scratch"]
        with self._lock:
            if e.key in self._kept:
                return
            dropped = 0
            while len(self._kept) >= self._buffer_blocks:
                self._kept.popitem(last=False)
                dropped += 1
            self._kept[e.key] = _owned(got)
            stats["issued"] += 1
            stats["wasted"] += dropped
        self.counters.add(pf_issued=1, pf_wasted=dropped)

    def _load(self, entries: list[BlockEntry]) -> list[Fetched]:
        """A batched load with the generations read before it: an upgrade mark set meanwhile
        makes a result look older than it may be (dropped, read again), never newer."""
        gens = self.offload.copies.generations([e.rec for e in entries])
        return [Fetched(d, g) for d, g in zip(self.offload.load_many(entries), gens)]

    def holds_nothing(self) -> bool:
        """Whether no block is buffered or kept: a read may then load every block itself."""
        return self._pool is None and not self._kept

    def not_held(self, entries: list[BlockEntry]) -> list[BlockEntry] | None:
        """The blocks of ``entries`` a read may load itself (none of them kept from a scratch
        read), or None while prefetching is on (its buffer is where a read takes blocks from)."""
        if self._pool is not None:
            return None
        if not self._kept:
            return entries
        with self._lock:
            kept = self._kept
            return [e for e in entries if e.key not in kept]

    def fetch_many(self, entries: list[BlockEntry]) -> list[Fetched]:
        """Non-resident blocks' data: each kept from a scratch read, or from the prefetch buffer
        if there and of its record's current generation; the others in one synchronous load."""
        if self.holds_nothing():
            return self._load(entries)  # no lookups (a CPU store's case)
        gens = self.offload.copies.generations([e.rec for e in entries])  # the state lock before ours (docs/architecture.md's lock order)
        out: list[Fetched | None] = []
        futs: list[Future | None] = []
        used = stale = 0
        with self._lock:
            for e, gen in zip(entries, gens):
                kept = self._kept.pop(e.key, None)
                if kept is not None and kept.generation != gen:
                    kept = None
                    stale += 1
                elif kept is not None:
                    used += 1
                out.append(kept)
                futs.append(self._futures.pop(e.key, None) if kept is None else None)
            self._by_source["scratch"]["used"] += used
            self._by_source["scratch"]["wasted"] += stale
        if used or stale:
            self.counters.add(pf_used=used, pf_wasted=stale)
        for i, (fut, gen) in enumerate(zip(futs, gens)):
            if fut is not None:
                out[i] = self._prefetched(fut, gen)
        todo = [i for i, got in enumerate(out) if got is None]
        if todo:
            for i, got in zip(todo, self._load([entries[i] for i in todo])):
                out[i] = got
        return out

    def _prefetched(self, fut: Future, gen: int) -> Fetched | None:
        """The result of a prefetch taken from the buffer if it is of generation ``gen``; None
        (counted wasted) when it is older or failed (then read synchronously)."""
        try:
            got = fut.result()
        except Exception:  # a failed prefetch is retried synchronously, and counted
            self.counters.add(pf_wasted=1, pf_errors=1)
            return None
        used = got.generation == gen
        self.counters.add(**{"pf_used" if used else "pf_wasted": 1})
        self._outcome(fut, used)
        return got if used else None

    def _outcome(self, fut: Future, used: bool) -> None:
        src = fut.kvtier_source
        with self._lock:
            self._outcomes[src].append(used)
            self._by_source[src]["used" if used else "wasted"] += 1

    def _discard(self, fut: Future) -> None:
        """An unused prefetch: cancel it, or wait for it so no load of a dropped block is in flight."""
        self.counters.add(pf_wasted=1)
        self._outcome(fut, False)
        if not fut.cancel() and fut.exception() is not None:
            self.counters.add(pf_errors=1)

    def forget(self, seq: int) -> None:
        """Drop ``seq``'s prefetches (waiting for any in flight) and its predictor state."""
        prefix = f"{seq}/"
        with self._lock:
            mine = [self._futures.pop(k) for k in list(self._futures) if k.startswith(prefix)]
            kept = [k for k in self._kept if k.startswith(prefix)]
            for k in kept:
                del self._kept[k]
            self._by_source["scratch"]["wasted"] += len(kept)
            for key in [k for k in self._last_sel if k[0] == seq]:
                del self._last_sel[key]
            self._dense_seqs.discard(seq)
        self.counters.add(pf_wasted=len(kept))
        for fut in mine:
            self._discard(fut)

    def by_source(self) -> dict:
        with self._lock:
            return {src: dict(v) for src, v in self._by_source.items()}

    def close(self) -> None:
        with self._lock:
            self._kept.clear()
        if self._pool is None:
            return
        with self._lock:
            futures = list(self._futures.values())
            self._futures.clear()
        for fut in futures:
            fut.cancel()
        self._pool.shutdown(wait=True)


def _owned(got: Fetched) -> Fetched:
    """``got`` with data of its own: a batched decode returns views of one batch tensor, which
    a block held in the buffer would otherwise keep alive whole."""
    return got if got.data._base is None else got._replace(data=got.data.clone())
