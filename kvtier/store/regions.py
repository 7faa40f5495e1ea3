"""L1 regions: where a table's resident blocks sit inside its own run of pool slots.

``gather_view`` needs the blocks a step attends at the front of the table's region and the open
block right after them, so K and V are views of the pool. Every method here runs with the state
lock held, called by ``Residency`` only; the worker reads a pending block's slot without the lock,
so a pending block is never moved.
"""
from __future__ import annotations

from .layout import Layout
from .stats import Counters
from .table import BlockEntry, BlockTable


class Regions:
    def __init__(self, layout: Layout, l1, counters: Counters) -> None:
        self.layout = layout
        self.l1 = l1
        self.counters = counters

    def run_position(self, t: BlockTable, run: frozenset) -> int | None:
        """A region position in ``[0, len(run) - 1)`` (where gather_view wants the selected
        blocks) for a block being swapped in: a free one, else one whose block is not in ``run``
        after moving that block to a free position past the run (one slot copy, instead of two
        or a swap when gather_view rearranges later). None: no such position."""
        nsel = len(run) - 1
        at = t.at
        for p in range(nsel):
            if at[p] is None:
                return p
        f = t.free_position(nsel + 1)
        if f is None:
            return None
        for p in range(nsel):
            y = at[p]
            if y not in run and not y.pending:
                self.move(t, y, t.base + f, t.entries[-1])
                self.counters.add(region_moves=1)
                return p
        return None

    def arrange(self, t: BlockTable, sel: list[BlockEntry], open_e: BlockEntry) -> bool:
        """Lay ``t``'s region out for a view: the entries ``sel`` at positions ``[0, len(sel))``
        in any order, ``open_e`` at ``len(sel)``; False, moving nothing, if a block that would
        move (in or out of that run) is pending (the worker reads its slot).

        ```
         before  [a][x][b][open][c][ ][y]     sel = {a, b, c}, nsel = 3
         plan    c -> 1 (hole: x is not selected); x -> 5 (free, past the run)
         after   [a][c][b][open][ ][x][y]     two block copies
        ```
        Moves go to free positions first (one copy each); a cycle with no free position left
        is broken by a swap (three copies).
        """
        plan = self._plan(t, sel, open_e)
        if plan is None:
            return False
        if not plan:
            return True  # steady state: the run is already in place
        self.counters.add(region_moves=self._carry_out(t, plan, open_e))
        return True

    def _plan(self, t: BlockTable, sel: list[BlockEntry], open_e: BlockEntry) -> dict | None:
        """Entry -> target region position for :meth:`arrange`; None where it cannot be done."""
        nsel = len(sel)
        base, cap, at = t.base, t.cap, t.at
        assert all(e.slot is not None for e in sel), "a pinned block left L1 during a read"
        movers = [e for e in sel if not 0 <= e.slot - base < nsel]
        if not movers and open_e.slot - base == nsel:
            return {}
        for e in movers:
            if not 0 <= e.slot - base < cap:
                return None  # in a scratch slot: the run cannot be laid out this step
        wanted = set(sel)
        holes = [p for p in range(nsel) if at[p] is None or at[p] not in wanted]
        assert len(holes) == len(movers), f"{len(holes)} holes for {len(movers)} blocks"
        plan = dict(zip(movers, holes))
        if open_e.slot - base != nsel:
            plan[open_e] = nsel
        evict = [at[p] for p in plan.values() if at[p] is not None and at[p] not in plan]
        if evict:
            # past the run: free positions first (one copy each), then those planned entries leave
            dest = [p for p in range(nsel + 1, cap) if at[p] is None]
            dest += [p for p in range(nsel + 1, cap) if at[p] is not None and at[p] in plan]
            assert len(dest) >= len(evict), f"region of {t.seq}/{t.layer} over-full: {t.resident} > {cap}"
            plan.update(zip(evict, dest))
        if any(e.pending for e in plan):
            return None
        return plan

    def _carry_out(self, t: BlockTable, plan: dict, open_e: BlockEntry) -> int:
        """Execute ``plan``; returns the block copies it took."""
        base, at = t.base, t.at
        moves = 0
        while plan:
            progress = False
            for e, p in list(plan.items()):
                if at[p] is None:
                    self.move(t, e, base + p, open_e)
                    del plan[e]
                    moves += 1
                    progress = True
            if progress:
                continue
            # only cycles left: every target is held by another planned entry
            e, p = next(iter(plan.items()))
            f = t.free_position()
            if f is not None:  # step aside into a free position: the cycle becomes a chain
                self.move(t, e, base + f, open_e)
                moves += 1
                continue
            y = at[p]
            if not self.l1.swap(e.key, y.key):
                raise RuntimeError(f"kvtier: L1 refused to swap region slots {e.slot} and {y.slot}")
            t.swap_positions(e, y)
            moves += 3
            del plan[e]
            if plan.get(y) == y.slot - base:
                del plan[y]
        return moves

    def move(self, t: BlockTable, e: BlockEntry, slot: int, open_e: BlockEntry) -> None:
        """Move ``e`` to the free region slot ``slot``. The open block copies only its filled
        tokens: it moves right after a seal, when it holds one or a few."""
        old = e.slot
        whole = e is not open_e
        if not self.l1.move(e.key, slot, copy=whole):
            raise RuntimeError(f"kvtier: L1 refused region slot {slot} of {t.seq}/{t.layer} although free")
        if not whole:
            fill = t.length - (len(t.entries) - 1) * self.layout.block_tokens
            pool = self.l1.pool
            pool[slot, :, :, :fill] = pool[old, :, :, :fill]  # [2, kv_heads, fill, head_dim]
        t.relocate(e, slot)
