"""Blocks a sparse read swaps into scratch slots (the region full of dirty blocks) leave L1 when
the read ends; their decoded data is kept for the next read of the same block, which then costs
no tier read and no decode. Bounded by prefetch_blocks, dropped with the sequence, exact."""
from .conftest import check_invariants
from .test_gather_view import check_view, filled


def region_full_store(tmp_path, **cfg):
    st, s, ref = filled(22, tmp_path, num_layers=1, block_tokens=4, device_tokens=16, budget_tokens=16,
                        attention="sparse", policy="lru", high_watermark=1.0, low_watermark=0.9, **cfg)
    st.flush()
    t = st.residency.tables[s][0]
    gone = [e.idx for e in t.entries[:-1] if e.slot is None]
    assert gone and t.resident == t.cap  # every slot of the region taken by a dirty block
    return st, s, ref, t, gone


def test_a_block_read_through_scratch_is_not_read_again_from_its_tier(tmp_path):
    st, s, ref, t, gone = region_full_store(tmp_path)
    sel = [gone[0], next(e.idx for e in t.entries[:-1] if e.slot is not None)]
    for n in (1, 2, 3):  # the region stays full: each read puts the block in scratch again
        K, V, pos, order = st.gather_view(s, 0, sel)
        check_view(st, ref, s, 0, sel, K, V, pos, order)
        st.flush()
        assert st.counters["scratch_uses"] >= n and st.counters["swap_in_blocks"] == 1
    by = st.stats()["prefetch"]["by_source"]["scratch"]
    assert by["issued"] >= 3 and by["used"] >= 2 and by["wasted"] == 0
    st.drop_sequence(s)  # what was kept for it goes too
    assert st.stats()["prefetch"]["by_source"]["scratch"]["wasted"] == 1
    assert not st.prefetcher._kept
    check_invariants(st)
    st.close()


def test_kept_blocks_are_bounded_by_prefetch_blocks(tmp_path):
    st, s, ref, t, gone = region_full_store(tmp_path, prefetch_blocks=1)
    assert len(gone) >= 2
    resident = next(e.idx for e in t.entries[:-1] if e.slot is not None)
    for b in gone[:2]:  # two blocks through scratch, one kept at a time: the older one goes
        K, V, pos, order = st.gather_view(s, 0, [b, resident])
        check_view(st, ref, s, 0, [b, resident], K, V, pos, order)
    st.flush()
    assert len(st.prefetcher._kept) == 1
    assert st.stats()["prefetch"]["by_source"]["scratch"]["wasted"] >= 1
    before = st.counters["swap_in_blocks"]
    K, V, pos, order = st.gather_view(s, 0, [gone[0], resident])  # dropped: read from its tier again
    check_view(st, ref, s, 0, [gone[0], resident], K, V, pos, order)
    assert st.counters["swap_in_blocks"] == before + 1
    st.close()
