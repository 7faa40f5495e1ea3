"""Swap-ins read many blocks with one get_many per tier: the same data as block-by-block reads,
and a corrupt record in a batch is a miss for that block only."""
import pytest
import torch

from .conftest import check_invariants, corrupt_l3_record, make_store


def _fill(st, tokens: int, head_dim: int, dtype=torch.float16):
    """One sequence of ``tokens`` random tokens (V = -K) appended a block at a step to layer 0 of
    ``st``, swap-outs settled; returns the sequence and its K [2, tokens, head_dim]."""
    s = st.add_sequence()
    k = torch.randn(2, tokens, head_dim).to(dtype)
    bt = st.block_tokens
    for i in range(0, tokens, bt):
        st.append(s, 0, k[:, i:i + bt], -k[:, i:i + bt])
        st.end_step()
    st.flush()
    return s, k


def _cold_store(tmp_path, **cfg):
    """A one-layer store whose older blocks have only their L3 copy (L2 spilled them), with the
    reference K of its tokens."""
    st = make_store(tmp_path, num_layers=1, block_tokens=4, device_tokens=12, budget_tokens=12, sink_tokens=0,
                    window_tokens=4, host_bytes=4096, attention="sparse", policy="sink-window", **cfg)
    s, k = _fill(st, 120, 8)
    cold = [e for e in st.residency.tables[s][0].entries[:-1] if e.slot is None and e.l3 and not e.l2]
    assert len(cold) >= 8
    return st, s, k, cold


def test_batch_equals_block_by_block_reads(tmp_path):
    st, s, k, cold = _cold_store(tmp_path)
    recs = [e.rec for e in cold]
    lone = [st.offload.read_copies([r], st.layout.device)[0] for r in recs]
    hits = st.stats()["hits"]["l3"]
    batch = st.offload.read_copies(recs, st.layout.device)
    assert st.stats()["hits"]["l3"] == hits + len(recs)
    for e, a, b in zip(cold, lone, batch):
        assert torch.equal(a, b)
        assert torch.equal(b[0], k[:, e.idx * 4:(e.idx + 1) * 4]) and torch.equal(b[1], -b[0])
    st.close()


def test_a_gather_reads_its_l3_blocks_in_one_batch(tmp_path):
    st, s, k, cold = _cold_store(tmp_path)
    calls = []
    get_many = st.offload.l3.get_many
    st.offload.l3.get_many = lambda keys: calls.append(list(keys)) or get_many(calls[-1])
    st.offload.l3.get = None  # any block-by-block L3 read fails the test
    K, V = st.gather(s, 0)
    assert torch.equal(K, k) and torch.equal(V, -k)
    assert len(calls) == 1 and sorted(calls[0]) == sorted(e.key for e in cold)
    check_invariants(st)
    st.close()


def test_a_corrupt_record_is_a_miss_for_its_block_only(tmp_path):
    st, s, k, cold = _cold_store(tmp_path)
    bad = cold[len(cold) // 2]
    corrupt_l3_record(st.offload.l3, bad.key)
    before = st.stats()
    got = st.offload.read_copies([e.rec for e in cold], st.layout.device)
    after = st.stats()
    assert got[cold.index(bad)] is None  # never the damaged bytes as KV
    for e, d in zip(cold, got):
        if e is not bad:
            assert torch.equal(d[0], k[:, e.idx * 4:(e.idx + 1) * 4])
    assert after["hits"]["l3"] - before["hits"]["l3"] == len(cold) - 1
    assert after["misses"]["l3"] - before["misses"]["l3"] == 1
    assert bad.key in st.offload.l3.corrupt_keys
    st.close()


def test_a_prefetch_batch_with_an_unreadable_block_fails_that_block_only(tmp_path):
    st, s, k, cold = _cold_store(tmp_path, prefetch=True)
    t = st.residency.tables[s][0]
    cold = cold[:8]
    bad = cold[3]
    corrupt_l3_record(st.offload.l3, bad.key)
    assert not st.prefetcher._futures  # nothing was read yet: every future below is of this batch
    st.prefetcher.prefetch(t, [e.idx for e in cold], "temporal")
    futs = {e.key: st.prefetcher._futures[e.key] for e in cold}
    for e in cold:
        if e is bad:
            assert isinstance(futs[e.key].exception(timeout=30), AssertionError)
        else:
            assert torch.equal(futs[e.key].result(timeout=30).data[0], k[:, e.idx * 4:(e.idx + 1) * 4])
    st.close()


def _after_gather(tmp_path, codec: str, one_by_one: bool):
    torch.manual_seed(0)  # the same tokens in both stores
    st, s, k, cold = _cold_store(tmp_path, codec=codec)
    io = st.offload.io
    if one_by_one:  # each record decoded alone, each install choosing its own victim
        io.decode_stored_many = lambda items, device: [io.decode_stored(v, t, device) for v, t in items]
        st.residency.make_room = lambda *a: None
    decoded = []  # blocks the in-place decoder decoded, per call
    if io.fast_decoder is not None:
        many = io.fast_decoder.decode_many

        def spy(bufs):
            out = many(bufs)
            decoded.append(sum(d is not None for d in out))
            return out
        io.fast_decoder.decode_many = spy
    blocks = sorted(e.idx for e in cold[:2])  # the L1 budget less the open block
    K, V, pos = st.gather_blocks(s, 0, blocks)
    if codec == "fp16":
        assert torch.equal(K, k[:, pos]) and torch.equal(V, -k[:, pos])
    else:
        assert decoded == ([1, 1] if one_by_one else [2])  # in place, both records in one call
    t = st.residency.tables[s][0]
    out = sorted(e.idx for e in t.entries if e.slot is not None), st.stats()["hits"], K, V
    check_invariants(st)
    st.close()
    return out


@pytest.mark.parametrize("codec", ["fp16", "int4"])
def test_a_batched_swap_in_decodes_and_evicts_as_one_by_one(tmp_path, codec):
    a = _after_gather(tmp_path / "a", codec, False)
    b = _after_gather(tmp_path / "b", codec, True)
    assert a[:2] == b[:2] and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])


def test_blocks_kept_past_a_read_own_their_data(tmp_path):
    from kvtier.store.prefetch import Fetched

    st, s, k, cold = _cold_store(tmp_path)
    batch = torch.stack([st.offload.read_copies([e.rec], st.layout.device)[0] for e in cold[:3]])
    st.prefetcher.keep(cold[0], Fetched(batch.unbind(0)[0], 0))  # a view of a batched decode
    kept = st.prefetcher._kept[cold[0].key].data
    assert kept._base is None and torch.equal(kept, batch[0])
    st.close()


def test_a_swap_in_batch_l1_refuses_places_no_block(tmp_path):
    st, s, k, cold = _cold_store(tmp_path)
    t = st.residency.tables[s][0]
    blocks = sorted(e.idx for e in cold[:2])
    resident = sorted(e.idx for e in t.entries if e.slot is not None)
    st.residency.l1.put_many_at = lambda keys, slots, values: 0  # L1 refuses the first slot
    with pytest.raises(RuntimeError, match="refused region slot"):
        st.gather_blocks(s, 0, blocks)
    # neither block holds a slot, the table's counts agree, and the data below L1 is intact
    assert all(t.entries[b].slot is None for b in blocks)
    assert t.resident == len(t.slotted) == sum(x is not None for x in t.at)
    assert set(resident) >= {e.idx for e in t.entries if e.slot is not None}
    del st.residency.l1.put_many_at
    K, V, pos = st.gather_blocks(s, 0, blocks)
    assert torch.equal(K, k[:, pos]) and torch.equal(V, -k[:, pos])
    check_invariants(st)
    st.close()


def _warm_store(direct: bool, dtype=torch.float16, codec="int4"):
    """A one-layer sparse store whose older blocks are in L2 only (no L3), with the reference
    K of its tokens; ``direct``: swap-ins decode straight into the L1 slots."""
    torch.manual_seed(1)
    st = make_store(None, num_layers=1, kv_heads=2, head_dim=16, dtype=dtype, block_tokens=4, device_tokens=20,
                    budget_tokens=20, sink_tokens=0, window_tokens=4, host_bytes=1 << 20, attention="sparse",
                    codec=codec, policy="lru")
    st.reader._direct = direct and st.reader._direct
    s, k = _fill(st, 160, 16, dtype)
    return st, s, k


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_direct_swap_in_reads_as_the_general_path(dtype):
    from kvtier.compress import cpu

    if not cpu.available():
        pytest.skip("no compiled kernels here")
    runs = []
    for direct in (True, False):
        st, s, k = _warm_store(direct, dtype)
        assert st.reader._direct == direct
        direct_blocks = []
        load = st.offload.load_l2_into
        st.offload.load_l2_into = lambda *a: (lambda g: direct_blocks.append(sum(x is not None for x in g)) or g)(load(*a))
        t = st.residency.tables[s][0]
        outs = []
        for sel in ([1, 5, 9, 13], [2, 5, 10, 30], [0, 3, 6, 12], [7, 8, 9, 31]):  # mostly L2 blocks
            K, V, pos, order = st.gather_view(s, 0, sel)
            outs.append((K.clone(), V.clone(), pos.clone(), list(order)))
        stats = st.stats()
        check_invariants(st)
        runs.append((outs, stats["hits"], direct_blocks, sorted(e.idx for e in t.entries if e.slot is not None)))
        st.close()
    (a, hits_a, direct_a, res_a), (b, hits_b, direct_b, res_b) = runs
    assert sum(direct_a) > 0 and not direct_b  # the direct path served the first store's swap-ins
    assert hits_a == hits_b and res_a == res_b
    for (ka, va, pa, oa), (kb, vb, pb, ob) in zip(a, b):
        assert oa == ob and torch.equal(pa, pb) and torch.equal(ka, kb) and torch.equal(va, vb)


def test_a_corrupt_l2_record_in_a_direct_swap_in_writes_nothing():
    from kvtier.compress import cpu

    if not cpu.available():
        pytest.skip("no compiled kernels here")
    st, s, k = _warm_store(True)
    t = st.residency.tables[s][0]
    ents = [e for e in t.entries[:-1] if e.slot is None and e.rec.l2][:3]
    assert len(ents) == 3
    st.gather_view(s, 0, [e.idx for e in ents[:1]])  # the decoder learns the layout
    ents = [e for e in ents if e.slot is None]
    l2 = st.offload.l2
    off, n = l2._locate(ents[-1].rec.key)
    l2._np[off + n - 1] ^= 0x40  # one byte of the last record's V payload
    pool = st.residency.l1.storage
    before = pool.clone()
    slots = list(range(len(ents)))  # whatever slots: nothing may be written to them
    got = st.offload.load_l2_into(ents, pool, st.residency.l1.slot_axis, slots)
    assert got == [None] * len(ents) and torch.equal(pool, before)  # nothing of the batch written
    # without the corrupt record the same call decodes the others into those slots
    got = st.offload.load_l2_into(ents[:-1], pool, st.residency.l1.slot_axis, slots[:-1])
    assert None not in got and not torch.equal(pool, before)
    for e, slot in zip(ents[:-1], slots):
        assert torch.equal(st.residency.l1.pool[slot], st.offload.load(e))
    st.close()


def _mixed_store(tmp_path, direct: bool):
    """A one-layer sparse int4 store whose older blocks are partly in L2, partly only in L3."""
    torch.manual_seed(2)
    st = make_store(tmp_path, num_layers=1, kv_heads=2, head_dim=16, block_tokens=4, device_tokens=20,
                    budget_tokens=20, sink_tokens=0, window_tokens=4, host_bytes=6144, attention="sparse",
                    codec="int4", policy="lru")
    st.reader._direct = direct and st.reader._direct
    return st, _fill(st, 160, 16)[0]


def test_a_read_mixing_direct_and_general_swap_ins_reads_as_the_general_path(tmp_path):
    from kvtier.compress import cpu

    if not cpu.available():
        pytest.skip("no compiled kernels here")
    runs = []
    for direct in (True, False):
        st, s = _mixed_store(tmp_path / str(direct), direct)
        t = st.residency.tables[s][0]
        sealed = t.entries[:-1]
        in_l2 = [e.idx for e in sealed if e.slot is None and e.rec.l2]
        only_l3 = [e.idx for e in sealed if e.slot is None and not e.rec.l2 and e.rec.l3]
        assert len(in_l2) >= 4 and len(only_l3) >= 4
        gave_back = []
        commit = st.residency.commit
        st.residency.commit = lambda tt, res, gens: (gave_back.append(sum(g is None for g in gens)),
                                                    commit(tt, res, gens))[1]
        outs = []
        for sel in (in_l2[:2] + only_l3[:2], only_l3[2:4] + in_l2[2:4], in_l2[-2:] + only_l3[-2:]):
            K, V, pos, order = st.gather_view(s, 0, sorted(sel))
            outs.append((K.clone(), V.clone(), pos.clone(), list(order)))
        check_invariants(st)
        runs.append((outs, st.stats()["hits"], gave_back))
        st.close()
    (a, hits_a, back_a), (b, hits_b, back_b) = runs
    assert sum(back_a) > 0 and not back_b  # L3-only blocks gave their reserved positions back
    assert hits_a == hits_b
    for (ka, va, pa, oa), (kb, vb, pb, ob) in zip(a, b):
        assert oa == ob and torch.equal(pa, pb) and torch.equal(ka, kb) and torch.equal(va, vb)
