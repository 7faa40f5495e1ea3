"""Reads: dense ``gather``, ``gather_blocks`` (copied out of L1) and ``gather_view`` (views of L1).

Blocks below L1 are swapped in through the prefetcher (its buffer, else a synchronous load) and
installed by ``Residency``. The blocks a read needs are pinned for its duration, so another
thread's step boundary cannot free one while this read swaps others in.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from .layout import Layout
from .prefetch import Fetched, Prefetcher
from .residency import Residency
from .stats import Counters
from .table import BlockEntry, BlockTable

_SWAP_IN_BATCH = 64  # blocks swapped in per batched read


class Reader:
    def __init__(self, layout: Layout, residency: Residency, prefetcher: Prefetcher, counters: Counters) -> None:
        self.layout = layout
        self.residency = residency
        self.prefetcher = prefetcher
        self.counters = counters
        self._arange_bt = np.arange(layout.block_tokens, dtype=np.int64)
        # swap-ins decoded straight into the pool (CPU, the in-place decoder; _swap_in_direct)
        self._direct = layout.device.type == "cpu" and prefetcher.offload.io.fast_decoder is not None

    @property
    def pool_kv(self) -> torch.Tensor:
        """[2, kv_heads, slots, block_tokens, head_dim]: read at each use (the pool may grow)."""
        return self.residency.l1.storage

    def gather(self, tables: list[BlockTable], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token of ``tables[layer]`` in order: K, V [kv_heads, T, head_dim]."""
        lay = self.layout
        t = tables[layer]
        n = len(t.entries)
        kvh, bt, hd = lay.kv_heads, lay.block_tokens, lay.head_dim
        if n == 0:
            empty = torch.empty(kvh, 0, hd, dtype=lay.dtype, device=lay.device)
            return empty, empty.clone()
        res_i, res_s, miss = self.residency.dense_reads(t)
        self.counters.add(hits_l1=len(res_i), misses_l1=len(miss))
        full = torch.empty(2, kvh, n, bt, hd, dtype=lay.dtype, device=lay.device)
        # residents first: a swap-in below may take a slot just freed by the worker
        if res_i:
            full.index_copy_(2, torch.tensor(res_i, device=lay.device),
                             self.pool_kv.index_select(2, torch.tensor(res_s, device=lay.device)))
        for _, part, fetched in self._swap_in(miss):
            for e, got in zip(part, fetched):
                full[:, :, e.idx] = got.data  # [2, kv_heads, block_tokens, head_dim]
                self.residency.keep_if_room(t, e, got.data, got.generation)
        self.prefetcher.dense_read(tables, layer, n)
        kv = full.view(2, kvh, n * bt, hd)[:, :, : t.length]  # [2, kv_heads, T, head_dim]
        return kv[0], kv[1]

    def _swap_in(self, ents: list[BlockEntry]) -> Iterator[tuple[int, list[BlockEntry], list[Fetched]]]:
        """The non-resident ``ents`` fetched ``_SWAP_IN_BATCH`` at a time, each batch with one
        tier read (a small record costs a fraction of a lone ``get``), the next fetched once the
        caller has installed this one (the decoded blocks waiting for it stay bounded): (where
        the batch starts in ``ents``, the batch, its data) per batch."""
        for j in range(0, len(ents), _SWAP_IN_BATCH):
            part = ents[j:j + _SWAP_IN_BATCH]
            yield j, part, self.prefetcher.fetch_many(part)

    def check_blocks(self, t: BlockTable, blocks: list[int]) -> None:
        ns = len(t.entries) - 1
        if ns < 0:
            raise ValueError(f"sequence {t.seq} layer {t.layer} is empty")
        device_blocks = self.layout.device_blocks
        if len(blocks) >= device_blocks:
            raise ValueError(f"blocks must number at most {device_blocks - 1} (the L1 budget less the "
                             f"open block); got {len(blocks)}")
        if blocks and not (0 <= min(blocks) and max(blocks) < ns):
            bad = next(b for b in blocks if not 0 <= b < ns)
            raise ValueError(f"blocks must be sealed block indices in [0, {ns}); got {bad}")

    def _prepare(self, t: BlockTable, blocks: list[int], view: bool) -> tuple[list[int], list[str]]:
        """Every block of ``blocks`` resident (a region slot, or a scratch slot listed in the
        returned ``scratch`` when the region is full), counted as a hit or a miss, and pinned
        (the caller unpins). Returns the L1 slot per block, the open block's last, and the
        scratch keys."""
        slots, miss = self.residency.pin_reads(t, blocks)
        self.counters.add(hits_l1=len(blocks) - len(miss), misses_l1=len(miss))
        scratch: list[str] = []
        if not miss:
            return slots, scratch
        ents = t.entries
        sel = frozenset(blocks)
        run = frozenset([ents[b] for b in blocks] + [ents[-1]]) if view else None
        if self._direct:
            miss = self._swap_in_direct(t, miss, slots, sel, run)
            if not miss:
                return slots, scratch
        try:
            for j, part, fetched in self._swap_in([e for _, e in miss]):
                self.residency.make_room(t, part, sel)
                n_scratch = len(scratch)
                got_slots = self.residency.install_many(t, part, fetched, sel, scratch, run)
                for (i, _), s in zip(miss[j:j + len(part)], got_slots):
                    slots[i] = s
                if len(scratch) > n_scratch:  # these leave L1 after this read: wanted again next step
                    scratch_slots = {self.residency.l1.slot_of(k) for k in scratch[n_scratch:]}
                    for e, got, s in zip(part, fetched, got_slots):
                        if s in scratch_slots:
                            self.prefetcher.keep(e, got)
        except BaseException:
            self.residency.free_scratch(scratch)  # a failed read leaves no slot behind
            raise
        return slots, scratch

    def _swap_in_direct(self, t: BlockTable, miss: list, slots: list[int], sel: frozenset,
                        run: frozenset | None) -> list:
        """The CPU swap-in without a decoded copy in between: region positions reserved for the
        missed blocks the budget has room for, their L2 records decoded straight into those
        slots, the slots bound. Fills ``slots``; returns the misses left to the general path
        (no room, no L2 copy, another layout, a corrupt batch), or all of them while the
        prefetcher is on (a read takes blocks from its buffer). Blocks kept from a scratch read
        are left to the general path, which takes them from the prefetcher."""
        todo = self.prefetcher.not_held([e for _, e in miss[:_SWAP_IN_BATCH]])
        if not todo:
            return miss
        res = self.residency
        with res.pool_lock:  # the pool does not move (grow) while its slots are written
            res.make_room(t, todo, sel)
            reserved = res.reserve(t, todo, sel, run)
            if not reserved:
                return miss
            try:
                gens = self.prefetcher.offload.load_l2_into(
                    [e for e, _ in reserved], res.l1.storage, res.l1.slot_axis, [e.slot for e, _ in reserved])
            except BaseException:
                res.commit(t, reserved, [None] * len(reserved))
                raise
            res.commit(t, reserved, gens)
        left = []
        for i, e in miss:
            if e.slot is not None:
                slots[i] = e.slot
            else:
                left.append((i, e))
        return left

    def gather_blocks(self, t: BlockTable, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.check_blocks(t, blocks)
        try:
            slots, scratch = self._prepare(t, blocks, view=False)
            return self._gather_copy(t, slots, blocks + [len(t.entries) - 1], scratch)
        finally:
            self.residency.unpin(t)

    def _gather_copy(self, t: BlockTable, slots: list[int], blocks: list[int],
                     scratch: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V [kv_heads, n, head_dim] and pos [n] of ``blocks`` (the open block last) at
        ``slots``, in that order, copied out of the pool; frees the ``scratch`` slots."""
        lay = self.layout
        idx, pos = self._gather_index(t, slots, blocks)
        bt = lay.block_tokens
        n = len(blocks)
        total = (n - 1) * bt + (t.length - (len(t.entries) - 1) * bt)
        g = self.pool_kv.index_select(2, idx)  # [2, kv_heads, n, bt, hd]
        if scratch:
            self.residency.free_scratch(scratch)
        kv = g.view(2, lay.kv_heads, n * bt, lay.head_dim)  # [2, kv_heads, n*bt, hd]
        if total < n * bt:
            kv = kv.narrow(2, 0, total)
            pos = pos[:total]
        k, v = kv.unbind(0)
        return k, v, pos.clone()  # the cached positions stay untouched whatever the caller does

    def gather_view(self, t: BlockTable, blocks: list[int]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        self.check_blocks(t, blocks)
        try:
            slots, scratch = self._prepare(t, blocks, view=True)
            order = None if scratch else self.residency.arrange(t, blocks)
            if order is None:
                self.counters.add(gather_copies=1)
                blocks = blocks + [len(t.entries) - 1]
                k, v, pos = self._gather_copy(t, slots, blocks, scratch)
                return k, v, pos, blocks
        finally:
            self.residency.unpin(t)
        self.counters.add(gather_views=1)
        return self._view(t, order)

    def _view(self, t: BlockTable, order: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """K, V, pos of the run at the front of ``t``'s region, laid out as ``order``."""
        lay = self.layout
        bt = lay.block_tokens
        n = len(order)
        t.view_n = n
        cached = t.view_cache
        if cached is not None and cached[0] == order:
            pos = cached[1]
        else:
            rows = np.asarray(order, dtype=np.int64)[:, None] * bt + self._arange_bt  # [n, bt]
            pos = torch.from_numpy(rows.ravel()).to(lay.device)
            t.view_cache = (order[:], pos)  # a copy: the caller owns the returned list
        run = t.run_kv  # read once: a growing pool resets it from another thread
        if run is None:
            # the whole region per plane and head as one run of tokens (reset when the pool grows)
            run = t.run_kv = self.pool_kv[:, :, t.base:t.base + t.cap].view(
                2, lay.kv_heads, t.cap * bt, lay.head_dim).unbind(0)  # 2 x [kv_heads, cap*bt, hd]
        total = (n - 1) * bt + (t.length - (len(t.entries) - 1) * bt)  # the open block's tail is past the end
        k_run, v_run = run
        return k_run.narrow(1, 0, total), v_run.narrow(1, 0, total), pos.narrow(0, 0, total), order

    def _gather_index(self, t: BlockTable, slots: list[int], blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool slots as an index tensor [n] and the token positions of ``blocks`` [n * bt] (the
        open block counted in full), both on the device.

        Adjacent decode steps mostly attend to the same blocks (same slots: sealed blocks never
        change), so the pair is kept per table and reused while the selection and slots stay the
        same. Both are pure functions of the two lists.
        """
        cached = t.gather_cache
        if cached is not None and cached[0] == slots and cached[1] == blocks:
            return cached[2], cached[3]
        # token positions: block b covers [b*bt, (b+1)*bt); built in numpy (one torch op less per
        # index than torch.tensor + arithmetic), moved to the device in one copy
        rows = np.asarray(blocks, dtype=np.int64)[:, None] * self.layout.block_tokens + self._arange_bt
        if self.layout.device.type == "cpu":
            idx = torch.from_numpy(np.array(slots, dtype=np.int64))
            pos = torch.from_numpy(rows.ravel())
        else:
            n = len(slots)
            both = torch.from_numpy(np.concatenate((np.array(slots, dtype=np.int64), rows.ravel())))
            both = both.to(self.layout.device)
            idx, pos = both[:n], both[n:]
        t.gather_cache = (slots, blocks, idx, pos)
        return idx, pos
