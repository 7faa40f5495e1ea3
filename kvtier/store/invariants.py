"""The consistency checks behind ``KVStore.check_invariants``: one picture of every block across
the tiers, the reference counts and the per-tier accounting."""
from __future__ import annotations

from .offload import CONTENT_KEY, OffloadTiers
from .residency import Residency


def check(residency: Residency, offload: OffloadTiers) -> None:
    """Raise AssertionError naming the first broken invariant. Call it with no swap-out or
    write-through in flight (``KVStore.flush``) and no other thread using the store."""
    with offload.lock:
        # the tiers' keys first: HostTier calls the spill (which takes the state lock) under its
        # own lock, so L2 is never called with the state lock held
        in_l2 = set(offload.l2.keys())
        on_disk = set(offload.l3.keys()) if offload.l3 is not None else set()
        with residency.lock:
            l1_keys, l2_keys, l3_keys, homes = _check_tables(residency)
            _check_records(residency)
            assert set(residency.l1.keys()) == l1_keys, "L1 holds slots no block owns (or misses some)"
            assert residency.home == homes, f"blocks per home tier {residency.home} != counted {homes}"
            assert in_l2 == l2_keys, "L2 keys differ from the blocks' L2 copies"
            if offload.l3 is not None:
                # content records no live block references (kept by drop_sequence(keep_prefix=True)
                # or left by an earlier process) may stay in L3 until it needs the room
                unreferenced = {k for k in on_disk - l3_keys if CONTENT_KEY.fullmatch(k) and k not in residency.copies}
                assert on_disk - unreferenced == l3_keys, "L3 keys differ from the blocks' L3 copies"
            else:
                assert not l3_keys, "L3 copies without an L3"
            below, counted = residency.copies.below, residency.copies.counted()
            assert below == counted, f"copies/bytes below L1 {below} != counted {counted}"


def _check_tables(residency: Residency):
    device_blocks = residency.layout.device_blocks
    l1_keys, l2_keys, l3_keys = set(), set(), set()
    homes = {"l1": 0, "l2": 0, "l3": 0}
    for tables in residency.tables.values():
        for t in tables:
            assert t.pending == 0, f"{t.seq}/{t.layer}: {t.pending} blocks still pending"
            assert t.resident == sum(e.slot is not None for e in t.entries) <= device_blocks, \
                f"{t.seq}/{t.layer}: resident count {t.resident} is wrong"
            assert t.slotted == {e.idx: e for e in t.entries if e.slot is not None}, "slotted map is wrong"
            assert not t.entries or t.entries[-1].slot is not None, "open block left L1"
            # region: every resident block in its table's own slots, at[] the inverse of slot
            assert len(t.at) == t.cap == device_blocks, "region size is wrong"
            assert {id(e): e.slot - t.base for e in t.entries if e.slot is not None} == \
                {id(e): p for p, e in enumerate(t.at) if e is not None}, "region map is not the inverse of slots"
            if t.entries and t.open_view is not None:
                assert t.open_view.data_ptr() == residency.l1.pool[t.entries[-1].slot].data_ptr(), \
                    "append views point away from the open block"
            for e in t.entries:
                assert not e.pending and e.home != "none", f"block lost: {e}"
                # a block whose swap-out failed is never a victim again: it stays in L1
                assert not e.held or e.slot is not None, f"held block left L1: {e}"
                homes[e.home] += 1
                if e.slot is not None:
                    l1_keys.add(e.key)
                    assert residency.l1.slot_of(e.key) == e.slot, f"L1 slot of {e.key} is not {e.slot}"
                assert e in e.rec.entries and residency.copies.get(e.rec.key) is e.rec, f"{e} not in its record"
                if e.l2:
                    l2_keys.add(e.rec.key)
                if e.l3:
                    l3_keys.add(e.rec.key)
    return l1_keys, l2_keys, l3_keys, homes


def _check_records(residency: Residency) -> None:
    holders: dict[int, int] = {}
    for tables in residency.tables.values():
        for t in tables:
            for e in t.entries:
                holders[id(e.rec)] = holders.get(id(e.rec), 0) + 1
    for key, rec in residency.copies.items():
        assert rec.key == key and rec.refs == holders.get(id(rec), 0) > 0, f"reference count of {rec} is wrong"
