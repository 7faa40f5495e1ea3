"""Residency: block tables, entries and L1 slot allocation.

The only part that writes them, always under ``lock`` (the state lock). A block's state
(``slot``, ``pending``, ``cancel``, ``fence``) and the per-home-tier block counts change only in
the methods below, so the counts follow every change. The records of the copies below L1 are a
part of their own under the same lock (``copies``: :class:`~kvtier.store.copies.CopyRecords`);
where a copy changes a block's home (an L2 copy put or dropped) this part calls it, so the home
counts follow. Methods that say "lock held" are called by another method of this part, or by a
part that was handed the lock by one (``Regions``, ``SequenceSurgery``); every other method takes
the lock itself.
"""
from __future__ import annotations

import itertools
import threading

import torch

from .copies import CopyRecords
from .keys import block_key
from .layout import Layout
from .regions import Regions
from .stats import Counters
from .swap import SwapOutError
from .table import BlockCopies, BlockEntry, BlockTable

_HOMES = ("l1", "l2", "l3")


class Residency:
    def __init__(self, layout: Layout, l1, policy, counters: Counters) -> None:
        self.lock = threading.Lock()
        # held by appends (they write the open block's slot without the state lock) and by a
        # growing pool (store.reserve_sequences); taken before ``lock``
        self.pool_lock = threading.Lock()
        self.layout = layout
        self.l1 = l1
        # CPU: the pool as a numpy array for decode appends (16-bit floats viewed as int16)
        self.np_view = torch.int16 if layout.dtype in (torch.float16, torch.bfloat16) else None
        self._pool_np = None
        if layout.device.type == "cpu":
            self._pool_np = (l1.pool if self.np_view is None else l1.pool.view(self.np_view)).numpy()
        self.policy = policy
        self.counters = counters
        self.regions = Regions(layout, l1, counters)
        self.tables: dict[int, list[BlockTable]] = {}
        self.by_key: dict[str, BlockEntry] = {}       # process-local key -> entry
        self.copies = CopyRecords(self.lock, counters)  # tier key -> copies below L1 (refcounted)
        self.home = dict.fromkeys(_HOMES, 0)          # blocks per home tier: stats() in O(tables)
        self.touched: dict[int, BlockTable] = {}      # tables appended to or read since end_step
        # the first swap-out failure of each sequence not yet raised to its caller
        self.failures: dict[int, SwapOutError] = {}
        self.step = 0
        self._next_seq = 0
        # region groups: one region of device_blocks slots per layer, for one live sequence; the
        # first max_sequences of them at the front of the pool, more appended by add_groups
        group = layout.num_layers * layout.device_blocks
        self._group_base = [g * group for g in range(layout.max_sequences)]  # first slot per group
        self._free_groups = list(range(layout.max_sequences))
        self._group: dict[int, int] = {}
        self._scratch_ids = itertools.count()

    # -- sequences -----------------------------------------------------------------------------

    def add_sequence(self) -> int | None:
        """A new sequence in a free region group; None when every group is taken (add_groups)."""
        lay = self.layout
        with self.lock:
            if not self._free_groups:
                return None
            seq = self._next_seq
            self._next_seq += 1
            g = self._group[seq] = self._free_groups.pop(0)
            c = lay.device_blocks
            base = self._group_base[g]
            self.tables[seq] = [BlockTable(seq, layer, lay.kv_heads, lay.head_dim, lay.device, lay.digest_dtype,
                                           lay.digest_score, lay.digest_parts,
                                           base=base + layer * c, cap=c, value_parts=lay.value_parts)
                                for layer in range(lay.num_layers)]
            return seq

    @property
    def groups(self) -> int:
        """Region groups in the pool (live sequences it holds without growing)."""
        return len(self._group_base)

    def free_groups(self) -> int:
        with self.lock:
            return len(self._free_groups)

    def add_groups(self, n: int, scratch_per_group: int) -> None:
        """Grow the L1 pool by ``n`` region groups and their scratch slots (MemoryError naming
        the bytes, changing nothing, when the device cannot hold it). The caller keeps every
        writer off the pool (the store's pool lock, nothing in flight); this re-points the views
        of the pool that tables and this part keep."""
        lay = self.layout
        group = lay.num_layers * lay.device_blocks
        with self.lock:
            first = self.l1.grow(n * group, n * scratch_per_group)
            g0 = len(self._group_base)
            self._group_base += [first + i * group for i in range(n)]
            self._free_groups += range(g0, g0 + n)
            if self._pool_np is not None:
                l1 = self.l1
                self._pool_np = (l1.pool if self.np_view is None else l1.pool.view(self.np_view)).numpy()
            for tables in self.tables.values():
                for t in tables:
                    t.run_kv = None  # reads.py builds it again from the new storage
                    if t.entries and t.entries[-1].slot is not None:
                        self._open_views(t)

    def table(self, seq: int, layer: int) -> BlockTable:
        tables = self.tables_of(seq)
        # an int in range only: a negative index (or True) would silently name another layer
        i = layer
        if type(i) is not int:
            i = -1 if isinstance(i, bool) or not hasattr(i, "__index__") else i.__index__()
        if not 0 <= i < len(tables):
            raise ValueError(f"layer must be an int in [0, {self.layout.num_layers}); got {layer!r}")
        return tables[i]

    def tables_of(self, seq: int) -> list[BlockTable]:
        """The tables (one per layer) of live sequence ``seq``; ValueError otherwise."""
        tables = self.live_tables(seq)
        if tables is None:
            raise ValueError(f"seq must be a live sequence id {self.sequences()}; got {seq!r}")
        return tables

    def live_tables(self, seq: int) -> list[BlockTable] | None:
        try:
            with self.lock:
                return self.tables.get(seq)
        except TypeError:  # unhashable
            return None

    def sequences(self) -> list[int]:
        with self.lock:
            return sorted(self.tables)

    def drop(self, seq: int, keep_prefix: bool) -> tuple[list[str], list[str]]:
        """Forget ``seq``'s tables and L1 slots; returns the tier keys whose last reference went
        (L2 copies, L3 copies) for the caller to delete."""
        drop2, drop3 = [], []
        with self.lock:
            for t in self.tables[seq]:
                for e in t.entries:
                    self._count_home(e.home, -1)
                    if e.slot is not None:
                        self.l1.delete(e.key)
                        e.slot = None
                    self.copies.release(e, drop2, drop3, keep_content=keep_prefix)
                    self.by_key.pop(e.key, None)
                self.touched.pop(id(t), None)
            del self.tables[seq]
            self.failures.pop(seq, None)
            self._free_groups.append(self._group.pop(seq))
        return drop2, drop3

    def _count_home(self, home: str, d: int) -> None:
        if home != "none":
            self.home[home] += d

    def _rehome(self, before: str, e: BlockEntry) -> None:
        """``e``'s home changed from ``before`` to what it is now (lock held)."""
        after = e.home
        if after != before:
            self._count_home(before, -1)
            self._count_home(after, 1)

    # -- append --------------------------------------------------------------------------------

    def appended(self, t: BlockTable, e: BlockEntry, length: int) -> None:
        """Tokens were written into ``e`` (the open block): ``t`` now holds ``length`` tokens."""
        with self.lock:
            t.length = length
            e.last_used = self.step
            self.touched[id(t)] = t

    def new_block(self, t: BlockTable) -> BlockEntry:
        """Append an entry for a new open block (no slot yet) to ``t``; first, so that the
        block sealed just before is an eviction candidate."""
        e = BlockEntry(len(t.entries), block_key(t.seq, t.layer, len(t.entries)))
        with self.lock:
            t.entries.append(e)
            self.by_key[e.key] = e
            self.copies.add(e.rec)
        return e

    def abandon_block(self, t: BlockTable, e: BlockEntry) -> None:
        """Undo ``new_block``: no room was found for it, so it was never opened."""
        with self.lock:
            assert t.entries and t.entries[-1] is e and e.slot is None, f"not the unplaced new block: {e}"
            t.entries.pop()
            del self.by_key[e.key]
            self.copies.forget(e.rec)

    def place_open(self, t: BlockTable, e: BlockEntry) -> None:
        """Give the new open block a region slot, past the last attended run (gather_view moves
        it to the end of that run). No copy: a slot's tokens past ``t.length`` are never read."""
        with self.lock:
            self._place(t, e, None, lo=t.view_n)
            self._open_views(t)

    def _open_views(self, t: BlockTable) -> None:
        """Point the append views at the open block's slot (after it was placed or moved)."""
        slot = t.entries[-1].slot
        t.open_view = self.l1.pool[slot]  # [2, kv_heads, block_tokens, head_dim] (strided)
        if self._pool_np is not None:
            t.open_np = self._pool_np[slot]  # the same slot as a numpy view (CPU)

    def seal(self, t: BlockTable, e: BlockEntry) -> None:
        with self.lock:
            # keys, values: [kv_heads, block_tokens, head_dim]
            t.set_digest(e.idx, self.l1.pool[e.slot, 0], self.l1.pool[e.slot, 1])
            e.last_used = self.step

    def _place(self, t: BlockTable, e: BlockEntry, data: torch.Tensor | None, lo: int = 0,
               pos: int | None = None) -> None:
        """Give ``e`` a free position of ``t``'s region (``pos`` if given, else the first at or
        after ``lo`` if any, else the first) and copy ``data`` [2, kv_heads, block_tokens,
        head_dim] there; ``None`` leaves the slot as it is. Lock held."""
        p = pos if pos is not None else t.free_position(min(lo, t.cap))
        if p is None:
            p = t.free_position(0)
        assert p is not None, f"region of {t.seq}/{t.layer} full although resident {t.resident} < {t.cap}"
        if not self.l1.put_at(e.key, t.base + p, data):
            raise RuntimeError(f"kvtier: L1 refused region slot {t.base + p} of {t.seq}/{t.layer} although "
                               f"it is free")
        before = e.home
        t.take_slot(e, t.base + p)
        self._rehome(before, e)

    # -- eviction ------------------------------------------------------------------------------

    def free_clean(self, t: BlockTable, e: BlockEntry, counter: str = "evicted_clean") -> None:
        """Drop the L1 copy of a clean block, counted as ``counter`` (lock held)."""
        self._free_clean_many(t, [e], counter)

    def _free_clean_many(self, t: BlockTable, ents: list[BlockEntry], counter: str = "evicted_clean") -> None:
        """:meth:`free_clean` of each of ``ents``, their L1 copies dropped in one ``delete_many``
        (lock held)."""
        for e in ents:
            assert e.clean and e.slot is not None and not e.pending, f"not a clean resident block: {e}"
        self.l1.delete_many([e.key for e in ents])
        for e in ents:
            t.free_slot(e)
            self._rehome("l1", e)
        self.counters.add(**{counter: len(ents)})

    def free_clean_victims(self, t: BlockTable, n: int, exclude, force: bool = True) -> None:
        """Free up to ``n`` clean blocks of ``t`` outside ``exclude``."""
        with self.lock:
            self._free_clean_victims(t, n, exclude, force)

    def _free_clean_victims(self, t: BlockTable, n: int, exclude, force: bool) -> None:
        """:meth:`free_clean_victims` with the lock held: the victims' L1 copies dropped in one
        ``delete_many``."""
        pinned = t.pinned
        out = self.policy.victims(t, n, exclude | pinned if pinned else exclude, only_clean=True, force=force,
                                  ordered=False)
        if out:
            self._free_clean_many(t, [t.entries[b] for b in out])

    def mark_victims(self, t: BlockTable, n: int, exclude=frozenset(), force: bool = False) -> list:
        """Choose ``n`` victims of ``t``: clean ones are freed now, dirty ones marked pending and
        returned as (table, entry) items for the swap-out worker."""
        with self.lock:
            return self._mark(t, self.policy.victims(t, n, exclude | t.pinned, force=force))

    def watermark_victims(self) -> list:
        """Step boundary: every table touched since the last one and over the high watermark
        gives victims down to the low one. Returns the items for the swap-out worker.

        Dirty victims are written below L1 and freed (asynchronously). Clean victims (a valid
        copy below L1) stay resident: each is already as cheap to reclaim as a free slot (no
        write; ``install``, ``make_room`` and a new open block drop one the moment its slot is
        wanted), so freeing it now buys no room, and when the next read selects it again (a
        sparse selection that fills L1 changes by a few blocks a step) it saves a swap-in. After
        the boundary, ``live - low`` victims are free, being written, or clean, as before; L1
        holds no more slots than its budget (the region), as before."""
        lay = self.layout
        items = []
        with self.lock:
            touched = list(self.touched.values())
            self.touched.clear()
            step = self.step
            self.step += 1
            for t in touched:
                live = t.resident - t.pending
                if live >= lay.high:
                    # blocks no read of this step used go first (the policy's order within each
                    # part): a sparse selection of the next step most likely wants the others
                    order = self.policy.victims(t, live, t.pinned)
                    ents = t.entries
                    order = [b for b in order if ents[b].last_used < step] + \
                            [b for b in order if ents[b].last_used >= step]
                    items += self._mark(t, order[:live - lay.low], free_clean=False)
        return items

    def _mark(self, t: BlockTable, victims: list[int], free_clean: bool = True) -> list:
        """Mark dirty ``victims`` pending (the items for the worker); clean ones are freed now,
        or left resident when not ``free_clean``. Lock held."""
        items = []
        plan = self.layout.precision
        ranking = None
        for b in victims:
            e = t.entries[b]
            if e.clean:
                if free_clean:
                    self.free_clean(t, e)
                continue
            if plan is not None:
                if ranking is None:  # once per table and batch: the statistics of its sealed blocks
                    ranking = plan.ranking(t.entries[:t.n_sealed])
                e.evict_codec = plan.choose(ranking, plan.statistic(e)) if e.seen else plan.base
            e.pending = True
            e.cancel = False
            t.pending += 1
            if self.layout.cuda:
                e.fence = torch.cuda.Event()  # after the last write into the slot
                e.fence.record()
            items.append((t, e))
        return items

    def pending_slot(self, e: BlockEntry) -> int | None:
        """The slot the worker encodes ``e`` from; None when the block is gone. A pending block's
        slot is never moved nor written, so it can be read after the lock is released."""
        with self.lock:
            return e.slot if e.key in self.by_key else None

    def is_clean(self, e: BlockEntry) -> bool:
        with self.lock:
            return e.clean

    def swapped_out(self, t: BlockTable, e: BlockEntry, nbytes: int | None, clean: bool) -> None:
        """The worker is done with pending ``e``: ``nbytes`` is the size of the L2 copy it put
        (None: L2 refused it, or the block was gone). ``clean``: another entry of the same
        content was copied below meanwhile, nothing was written. The slot is freed unless a
        reader marked the block meanwhile (``cancel``: it stays resident, now clean). An item
        already settled is left as it is, as :meth:`swap_failed` and :meth:`release_pending` do: a
        second settlement would take the table's pending count below zero (``flush`` and the
        eviction rounds read that count)."""
        with self.lock:
            if not e.pending:
                return
            if nbytes is not None or clean:
                if clean:
                    self.counters.add(evicted_clean=1)
                else:
                    self.copies.landed_l2(e.rec, nbytes, e.evict_codec)
                    self.counters.add(swap_out_l2_bytes=nbytes, swap_out_blocks=1, evicted_dirty=1)
                if not e.cancel and e.slot is not None:
                    self.l1.delete(e.key)
                    t.free_slot(e)
                    self._rehome("l1", e)  # to l2, or l3 for a block clean there
            self._unpend(t, e)

    def swap_failed(self, t: BlockTable, e: BlockEntry, exc: Exception) -> None:
        """The worker could not swap pending ``e`` out (``exc`` raised): it stays resident at full
        precision, ``held`` (never a victim again), and the failure is kept for ``t``'s sequence
        (its first one only) until :meth:`take_failure` hands it to that sequence's caller."""
        with self.lock:
            if e.pending:
                self._unpend(t, e)
            if e.key not in self.by_key:
                return  # dropped meanwhile: nobody to tell
            e.held = True
            self.counters.add(swap_out_failed=1)
            if t.seq not in self.failures:
                self.failures[t.seq] = SwapOutError(t.seq, t.layer, e.idx, exc)

    def held_blocks(self, t: BlockTable) -> int:
        """How many of ``t``'s resident blocks are held in L1 after a failed swap-out."""
        with self.lock:
            return sum(1 for e in t.slotted.values() if e.held)

    def take_failure(self, seq: int) -> SwapOutError | None:
        """The swap-out failure of ``seq`` not yet raised (then forgotten), or None."""
        with self.lock:
            return self.failures.pop(seq, None)

    def release_pending(self, items: list) -> None:
        """Items the worker could not process (an exception): no longer pending."""
        with self.lock:
            for t, e in items:
                if e.pending:
                    self._unpend(t, e)

    def _unpend(self, t: BlockTable, e: BlockEntry) -> None:
        e.pending = False
        e.cancel = False
        t.pending -= 1

    # -- reads ---------------------------------------------------------------------------------

    def pin_reads(self, t: BlockTable, blocks: list[int]) -> tuple[list[int], list]:
        """Start a read of sealed ``blocks`` and the open block of ``t``: they are marked used and
        pinned (no eviction frees them until :meth:`unpin`), a pending one is told to keep its slot
        after its copy. Returns the slot per block (the open block's last; 0 for a miss) and the
        misses as (position in ``blocks``, entry)."""
        ents = t.entries
        slots = [0] * (len(blocks) + 1)
        miss = []
        with self.lock:
            step = self.step
            t.pinned = frozenset(blocks)
            for i, b in enumerate(blocks):
                e = ents[b]
                e.last_used = step
                if e.slot is None or self._drop_outdated(t, e):
                    miss.append((i, e))
                else:
                    slots[i] = e.slot
                    e.cancel = e.cancel or e.pending
            e = ents[-1]
            slots[-1] = e.slot
            e.last_used = step
            self.touched[id(t)] = t
        return slots, miss

    def unpin(self, t: BlockTable) -> None:
        with self.lock:
            t.pinned = frozenset()

    def dense_reads(self, t: BlockTable) -> tuple[list[int], list[int], list[BlockEntry]]:
        """Start a dense read of every block of ``t``: (resident indices, their slots, misses)."""
        res_i, res_s, miss = [], [], []
        with self.lock:
            step = self.step
            for e in t.entries:
                e.last_used = step
                if e.slot is None or self._drop_outdated(t, e):
                    miss.append(e)
                else:
                    res_i.append(e.idx)
                    res_s.append(e.slot)
                    # being read: the worker keeps the slot after its copy (it is then clean,
                    # and leaves without a write when its slot is wanted)
                    e.cancel = e.cancel or e.pending
            self.touched[id(t)] = t
        return res_i, res_s, miss

    def keep_if_room(self, t: BlockTable, e: BlockEntry, data: torch.Tensor, generation: int) -> None:
        """A dense read swapped ``e`` in (its copy read at record ``generation``): make it
        resident while the region has room."""
        with self.lock:
            if e.slot is None and t.resident < self.layout.device_blocks:
                self._place(t, e, data)
                self._note_low(e, generation)

    def make_room(self, t: BlockTable, ents: list[BlockEntry], exclude) -> None:
        """Free, in one choice of victims, the clean blocks outside ``exclude`` that installing
        ``ents`` will need room for: what :meth:`install` would free one block at a time (the
        installed blocks are in ``exclude``, so the policy's order of the others is the same),
        without a scan and sort of the region per block."""
        with self.lock:
            need = t.resident + sum(1 for e in ents if e.slot is None) - self.layout.device_blocks
            if need > 0:
                self._free_clean_victims(t, need, exclude, force=False)

    def _install_scratch(self, data: torch.Tensor, device_blocks: int, scratch: list) -> int:
        """A scratch slot holding ``data``, its key listed in ``scratch`` (lock held)."""
        assert len(scratch) < max(1, device_blocks - 1), "more scratch blocks than the L1 budget"
        key = f"scratch/{next(self._scratch_ids)}"
        if not self.l1.put(key, data):
            raise RuntimeError("kvtier: L1 scratch slots exhausted although every read stays "
                               "within its budget")
        scratch.append(key)
        self.counters.add(scratch_uses=1)
        return self.l1.slot_of(key)

    def install_many(self, t: BlockTable, ents: list[BlockEntry], fetched: list, exclude, scratch: list,
                     run: frozenset | None = None) -> list[int]:
        """Give each swapped-in block of ``ents`` an L1 slot (``fetched``: its data and the
        generation of its record when its copy was read, as the prefetcher hands them over): its
        own if the budget allows (dropping a clean block outside ``exclude`` if needed), else a
        scratch slot listed in ``scratch``. ``run``: the entries of a gather_view (the open block
        included): a block is placed straight into that run's span of the region when possible.
        Returns the slots. One hold of the lock for the batch; the region slots are bound and
        filled by one L1 call once every position is chosen, and should L1 refuse one, no block of
        the batch is placed."""
        device_blocks = self.layout.device_blocks
        out: list[int] = []
        placed: list[tuple[BlockEntry, str, int]] = []  # (entry, home before, generation) placed here
        datas: list[torch.Tensor] = []
        with self.lock:
            try:
                for e, got in zip(ents, fetched):
                    if e.slot is None:
                        before = self._take_position(t, e, exclude, run, device_blocks)
                        if before is None:
                            out.append(self._install_scratch(got.data, device_blocks, scratch))
                            continue
                        placed.append((e, before, got.generation))
                        datas.append(got.data)
                    out.append(e.slot)
                if placed:
                    self._bind_placed(t, placed, datas)
            except BaseException:
                for e, _, _ in placed:  # nothing was bound in L1: only the table's bookkeeping to undo
                    t.free_slot(e)
                raise
        return out

    def reserve(self, t: BlockTable, ents: list[BlockEntry], exclude, run: frozenset | None = None
                ) -> list[tuple[BlockEntry, str]]:
        """Region positions for the non-resident blocks of ``ents`` that fit the budget, chosen
        as :meth:`install_many` chooses them, for data written into their slots before
        :meth:`commit`: each holds its slot in the table, not yet bound in L1. Returns (entry,
        home before) per reserved block, in the order of ``ents``; the others (already resident,
        or no room: a scratch slot's case) are left to :meth:`install_many`."""
        device_blocks = self.layout.device_blocks
        out: list[tuple[BlockEntry, str]] = []
        with self.lock:
            for e in ents:
                if e.slot is None:
                    before = self._take_position(t, e, exclude, run, device_blocks)
                    if before is None:
                        break
                    out.append((e, before))
        return out

    def commit(self, t: BlockTable, reserved: list[tuple[BlockEntry, str]], generations: list[int | None]) -> None:
        """Settle blocks :meth:`reserve` placed: those with a generation (of their record when
        their copy was read) hold their data now and are bound in L1; the others (None: nothing
        was written) give their positions back."""
        with self.lock:
            keep = [(e, before, g) for (e, before), g in zip(reserved, generations) if g is not None]
            for (e, _), g in zip(reserved, generations):
                if g is None:
                    t.free_slot(e)
            if keep:
                try:
                    self._bind_placed(t, keep, None)
                except BaseException:
                    for e, _, _ in keep:
                        t.free_slot(e)
                    raise

    def _take_position(self, t: BlockTable, e: BlockEntry, exclude, run: frozenset | None,
                       device_blocks: int) -> str | None:
        """A region position for non-resident ``e`` (dropping a clean block outside ``exclude``
        when the budget is full; in ``run``'s span when possible), held in the table only, not
        yet bound in L1; returns ``e``'s home before, or None when there is no room (lock held)."""
        if t.resident >= device_blocks:
            self._free_clean_victims(t, 1, exclude, force=False)
            if t.resident >= device_blocks:
                return None
        pos = self.regions.run_position(t, run) if run is not None else None
        p = pos if pos is not None else t.free_position(0)
        assert p is not None, f"region of {t.seq}/{t.layer} full although resident {t.resident} < {t.cap}"
        before = e.home
        t.take_slot(e, t.base + p)
        return before

    def _bind_placed(self, t: BlockTable, placed: list[tuple[BlockEntry, str, int]],
                     datas: list[torch.Tensor] | None) -> None:
        """Bind the slots of ``placed`` (entry, home before, generation) in L1, filled with
        ``datas`` (None: already written), and settle their homes. Raises, binding none, when L1
        refuses one; the caller gives the positions back (lock held)."""
        refused = self.l1.put_many_at([e.key for e, _, _ in placed], [e.slot for e, _, _ in placed], datas)
        if refused is not None:
            raise RuntimeError(f"kvtier: L1 refused region slot {placed[refused][0].slot} of {t.seq}/{t.layer} "
                               f"although it is free")
        for e, before, generation in placed:
            self._rehome(before, e)
            self._note_low(e, generation)

    def free_scratch(self, keys: list[str]) -> None:
        with self.lock:
            for key in keys:
                self.l1.delete(key)

    def arrange(self, t: BlockTable, blocks: list[int]) -> list[int] | None:
        """Lay out ``t``'s region for a view of ``blocks`` and the open block (``Regions``);
        returns the block order of the run, or None where it cannot be done this step."""
        ents = t.entries
        with self.lock:
            open_slot = ents[-1].slot
            if not self.regions.arrange(t, [ents[b] for b in blocks], ents[-1]):
                return None
            if ents[-1].slot != open_slot:
                self._open_views(t)  # appends write through views of the open block's slot
            return [e.idx for e in t.at[:len(blocks) + 1]]

    def observe(self, t: BlockTable, blocks: list[int], mass: list[float], snap_steps: int) -> None:
        with self.lock:
            ents = t.entries
            t.observed += 1
            snap = t.observed <= snap_steps
            for b, x in zip(blocks, mass):
                e = ents[b]
                e.mass += x
                if snap:
                    e.importance += x
            plan = self.layout.precision
            mean = sum(mass) / len(mass) if mass else 0.0
            if plan is None or mean <= 0:
                return
            for b, x in zip(blocks, mass):
                e = ents[b]
                e.rel_mass += x / mean
                e.seen += 1
            self._mark_recalled(t, plan, blocks, mass)

    def _mark_recalled(self, t: BlockTable, plan, blocks: list[int], mass: list[float]) -> None:
        """Mark for upgrade the blocks below base that this observation found heavy (lock held).
        A new mark bumps the record's ``marks``: data decoded before it is stale (the prefetcher
        serves no kept block of an older generation, and a resident decode of the low copy is
        freed by the next read of its block: ``_drop_outdated``)."""
        prot = self.policy.protected(t)
        n = t.n_sealed
        candidates = [x for b, x in zip(blocks, mass) if b < n and b not in prot]
        threshold = plan.recall_threshold(candidates, mass)
        if threshold is None:
            return
        ents = t.entries
        for b, x in zip(blocks, mass):
            if x < threshold or b >= n:
                continue
            rec = ents[b].rec
            if rec.l2 and rec.l2_codec is not None and plan.below_base(rec.l2_codec) and not rec.upgrade:
                rec.upgrade = True
                rec.marks += 1
                self.counters.add(precision_marked=1)

    def _note_low(self, e: BlockEntry, generation: int) -> None:
        """``e``'s new L1 copy was decoded from a copy below L1 read at record ``generation``.
        Note whether it may be the decode of a copy below the base codec (it is when L2 holds
        the block below base; it may be when a mark came after the read), so that a mark
        replaces it at the block's next read (lock held)."""
        plan = self.layout.precision
        if plan is None:
            return
        rec = e.rec
        low = rec.l2 and rec.l2_codec is not None and plan.below_base(rec.l2_codec)
        e.low_gen = generation if low or generation != rec.marks else None

    def _drop_outdated(self, t: BlockTable, e: BlockEntry) -> bool:
        """Free resident ``e``'s L1 copy if it is the decode of a low copy marked for upgrade
        after it was read, with the backup in L3: the read starting now then swaps the block in
        again, from the backup (as a mark on a block below L1 takes effect at its next read).
        The copy is clean (decoded from a copy below), so freeing it writes nothing. Lock held."""
        g = e.low_gen
        if g is None or g == e.rec.marks or not e.rec.l3 or e.pending or not e.clean:
            return False
        self.free_clean(t, e, "precision_refetched")
        return True

    # -- copies below L1 -----------------------------------------------------------------------

    def spilled(self, recs: list[BlockCopies]) -> None:
        """The ring dropped these records' L2 copies after spilling them: L3 now holds each
        block's copy below L1 and is the home of its non-resident entries."""
        with self.lock:
            for rec in recs:
                rec.written_through = False
                if not rec.l2:
                    continue
                before = [e.home for e in rec.entries]
                self.copies.left_l2(rec)
                for h, e in zip(before, rec.entries):
                    self._rehome(h, e)

    def resident_copy(self, key: str) -> tuple[BlockCopies | None, torch.Tensor | None]:
        """The record under ``key`` and a copy of one resident entry's block (None if none)."""
        with self.lock:
            rec = self.copies.get(key)
            if rec is not None:
                for e in rec.entries:
                    if e.slot is not None:  # slots are freed under this lock: safe to copy
                        return rec, self.l1.pool[e.slot].clone()  # [2, kv_heads, bt, head_dim]
        return rec, None

    def open_tokens(self, t: BlockTable, n: int) -> torch.Tensor:
        """A copy of the first ``n`` tokens of ``t``'s open block: [2, kv_heads, n, head_dim]."""
        lay = self.layout
        with self.lock:
            if n:
                return self.l1.pool[t.entries[-1].slot, :, :, :n].clone()
        return torch.empty(2, lay.kv_heads, 0, lay.head_dim, dtype=lay.dtype, device=lay.device)

    def export_state(self, e: BlockEntry) -> tuple[bool, bool, str, torch.Tensor | None]:
        """(has L2 copy, has L3 copy, tier key, a copy of its L1 data or None)."""
        with self.lock:
            rec = e.rec
            data = self.l1.pool[e.slot].clone() if e.slot is not None else None
            return rec.l2, rec.l3, rec.key, data

    def may_get_content(self, e: BlockEntry) -> bool:
        """Whether sealed ``e`` may still switch to a content-addressed record: resident, never
        copied below L1, not pending."""
        with self.lock:
            old = e.rec
            return not (old.content or old.l2 or old.l3 or e.pending or e.slot is None)

    def join_content(self, e: BlockEntry, key: str,
                     adopt_bytes: int | None) -> tuple[BlockCopies, torch.Tensor | None]:
        """Move ``e`` to the content-addressed record ``key``: the existing one (dedup), or a new
        one adopting an L3 copy of ``adopt_bytes`` left by an earlier process. Returns the
        record and, when a new record needs a write-through, a copy of the block for it."""
        with self.lock:
            rec, new = self.copies.join(key, adopt_bytes)
            old = e.rec
            old.entries.remove(e)
            if not old.entries:
                self.copies.forget(old)
            e.rec = rec
            rec.entries.append(e)
            if new and self.copies.lacks(rec):
                return rec, self.l1.pool[e.slot].clone()  # [2, kv_heads, bt, head_dim]
            return rec, None
