import json
import random

import pytest
import torch

from kvtier.store import KVStore

from .conftest import Ref, assert_gathers, assert_rows, check_invariants, make_store, random_chunk


@pytest.mark.parametrize("stage", [{}, {"byte_stage": "zstd", "byte_stage_l2": True}], ids=["lz4", "zstd-l2"])
def test_nothing_lost_fp16_tiny_tiers(tmp_path, rng, stage):
    """Thousands of randomly interleaved appends over several sequences and layers, with L1 and L2
    so small that blocks keep moving to L3: every token reads back bit-exact, wherever it lives
    (also with zstd on L2 records, spilled to L3 as they are)."""
    st = make_store(tmp_path, num_layers=3, device_tokens=8, host_bytes=4096, **stage)
    ref = Ref()
    seqs = [st.add_sequence() for _ in range(3)]
    for it in range(3000):
        s, layer = rng.choice(seqs), rng.randrange(3)
        k, v = random_chunk(rng)
        st.append(s, layer, k, v)
        ref.add(s, layer, k, v)
        if rng.random() < 0.3:
            st.end_step()
        if it % 150 == 0:
            assert_gathers(st, ref, s, layer)
        if it % 40 == 0 and st.seq_len(s, layer) > 8:
            ns = st.seq_len(s, layer) // 4 - (st.seq_len(s, layer) % 4 == 0)
            blocks = sorted(rng.sample(range(ns), 1))  # hot_blocks - 1
            K, V, pos = st.gather_blocks(s, layer, blocks)
            assert_rows(ref, s, layer, K, V, pos)
    check_invariants(st)
    for (s, layer) in ref.chunks:
        K, V = st.gather(s, layer)
        rk, rv = ref.kv(s, layer)
        assert torch.equal(K, rk) and torch.equal(V, rv)
        assert st.seq_len(s, layer) == rk.shape[1]
    stats = st.stats()
    json.dumps(stats)
    assert stats["blocks"]["l3"] > 100 and stats["hits"]["l3"] > 0 and stats["copies"]["l2"] > 0
    assert stats["tokens"] == sum(ref.kv(s, layer)[0].shape[1] for (s, layer) in ref.chunks)
    st.close()


def test_gather_blocks_order_positions_and_open_block(rng):
    st = make_store(None, num_layers=1, device_tokens=64, host_bytes=1 << 20)
    s = st.add_sequence()
    k = torch.randn(2, 30, 8).half()
    v = torch.randn(2, 30, 8).half()
    st.append(s, 0, k, v)  # blocks 0..6 sealed (28 tokens), open block 7 holds 2
    K, V, pos = st.gather_blocks(s, 0, [1, 4])
    want = list(range(4, 8)) + list(range(16, 20)) + [28, 29]
    assert pos.tolist() == want
    assert torch.equal(K, k[:, want]) and torch.equal(V, v[:, want])
    with pytest.raises(ValueError, match="blocks"):
        st.gather_blocks(s, 0, [7])
    with pytest.raises(ValueError, match="seq"):
        st.append(99, 0, k, v)
    with pytest.raises(ValueError, match="k and v"):
        st.append(s, 0, k[:1], v[:1])
    st.close()


def test_block_boundary_keeps_last_full_block_open():
    st = make_store(None, num_layers=1)
    s = st.add_sequence()
    k = torch.randn(2, 8, 8).half()
    st.append(s, 0, k, k)
    K, _, pos = st.gather_blocks(s, 0, [])
    assert pos.tolist() == [4, 5, 6, 7] and torch.equal(K, k[:, 4:])
    st.close()


def test_select_sinks_window_and_topk():
    st = make_store(None, num_layers=2, block_tokens=4, device_tokens=24, budget_tokens=20,
                    sink_tokens=4, window_tokens=4, attention="sparse", prefetch=False)
    s = st.add_sequence()
    k = torch.randn(2, 42, 8).half() * 0.01  # 10 sealed blocks + open block of 2
    k[:, 5 * 4 + 1, 3] = 50.0  # block 5 holds a key aligned with the query
    k[:, 7 * 4 + 2, 3] = 20.0  # block 7 too, less so
    st.append(s, 0, k, k)
    q = torch.zeros(6, 1, 8)  # 3 query heads per kv head
    q[:, :, 3] = 1.0
    # budget 20 tokens = 5 blocks: open + sink 0 + window 9 + top-2 {5, 7}
    assert st.select(s, 0, q) == [0, 5, 7, 9]
    assert st.select(s, 0, q, budget_tokens=16) == [0, 5, 9]
    with pytest.raises(ValueError, match="budget_tokens"):
        st.select(s, 0, q, budget_tokens=64)
    # a per-call budget is whole blocks too: 18 tokens would be rounded down to 16
    with pytest.raises(ValueError, match=r"budget_tokens must be a whole number of blocks \(block_tokens=4\)"):
        st.select(s, 0, q, budget_tokens=18)
    st.close()


def test_sparse_miss_swaps_in_from_any_tier(tmp_path):
    """A block evicted long ago to L3 comes back when the query asks for it."""
    st = make_store(tmp_path, num_layers=1, block_tokens=4, device_tokens=12, budget_tokens=12,
                    sink_tokens=0, window_tokens=4, host_bytes=4096, attention="sparse", policy="sink-window")
    s = st.add_sequence()
    k = torch.randn(2, 200, 8).half() * 0.01
    k[:, 9, 5] = 30.0  # block 2
    for i in range(200):
        st.append(s, 0, k[:, i:i + 1], k[:, i:i + 1])
        st.end_step()
    st.flush()
    e = st.residency.tables[s][0].entries[2]
    assert e.slot is None and e.l3 and not e.l2
    q = torch.zeros(2, 1, 8)
    q[:, :, 5] = 1.0
    sel = st.select(s, 0, q)
    assert 2 in sel
    K, _, pos = st.gather_blocks(s, 0, sel)
    assert torch.equal(K, k[:, pos])
    assert st.stats()["hits"]["l3"] >= 1
    check_invariants(st)
    st.close()


def _workload(st: KVStore, seed: int, steps: int = 400):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    ref = Ref()
    seqs = [st.add_sequence() for _ in range(2)]
    for _ in range(steps):
        s, layer = rng.choice(seqs), rng.randrange(st.num_layers)
        k, v = random_chunk(rng, head_dim=st.head_dim, sizes=(1, 1, 3, 7))
        st.append(s, layer, k, v)
        ref.add(s, layer, k, v)
        if rng.random() < 0.5:
            st.end_step()
    st.flush()
    return ref


def test_orders_identical_with_lossless_codec(tmp_path):
    out = {}
    for order in ("compress-then-tier", "tier-then-compress"):
        st = make_store(tmp_path / order, order=order, codec="fp16", device_tokens=8, host_bytes=4096)
        ref = _workload(st, seed=7)
        check_invariants(st)
        out[order] = {key: st.gather(*key) for key in ref.chunks}
        for key in ref.chunks:
            rk, rv = ref.kv(*key)
            assert torch.equal(out[order][key][0], rk) and torch.equal(out[order][key][1], rv)
        stats = st.stats()
        out[order + "/stats"] = (stats["blocks"], stats["bytes"], sorted(stats))
        st.close()
    a, b = out["compress-then-tier"], out["tier-then-compress"]
    for key in a:
        assert torch.equal(a[key][0], b[key][0]) and torch.equal(a[key][1], b[key][1])
    assert out["compress-then-tier/stats"] == out["tier-then-compress/stats"]


def _one_sequence(st, tokens: int, hd: int):
    """A new sequence of ``tokens`` random fp16 tokens (2 kv heads) in layer 0, swap-outs done."""
    s = st.add_sequence()
    torch.manual_seed(0)
    k = torch.randn(2, tokens, hd).half()
    v = torch.randn(2, tokens, hd).half()
    st.append(s, 0, k, v)
    st.end_step()
    st.flush()
    return s, k, v


@pytest.mark.parametrize("stage, stage_l2", [("lz4", False), ("zstd", False), ("zstd", True)])
@pytest.mark.parametrize("order", ["compress-then-tier", "tier-then-compress"])
def test_orders_expected_bytes_per_tier_with_lossy_codec(tmp_path, order, stage, stage_l2):
    from kvtier.compress import get_codec
    from kvtier.compress.bytestage import ByteStage
    from kvtier.store.blockrecord import pack_block

    bt, hd = 32, 32
    st = make_store(tmp_path, num_layers=1, block_tokens=bt, head_dim=hd, device_tokens=2 * bt,
                    host_bytes=64 << 10, codec="int8", order=order, policy="sink-window",
                    sink_tokens=0, window_tokens=0, budget_tokens=bt, byte_stage=stage,
                    byte_stage_l2=stage_l2)
    s, k, v = _one_sequence(st, 40 * bt + 3, hd)
    check_invariants(st)

    def rec(name, b):
        kc = get_codec(name, **st.cfg.codec_kwargs(name, "key"))  # the store's codecs (int8_zero_point)
        vc = get_codec(name, **st.cfg.codec_kwargs(name, "value"))
        return pack_block(kc.encode(k[:, b * bt:(b + 1) * bt]), vc.encode(v[:, b * bt:(b + 1) * bt])), kc, vc

    bs = ByteStage(stage, st.cfg.byte_stage_min_saving)
    host = "int8" if order == "compress-then-tier" else "fp16"
    exp = {"l2": 0, "l3": 0}
    ents = st.residency.tables[s][0].entries
    for e in ents[:-1]:
        if e.l2:
            r = rec(host, e.idx)[0]
            exp["l2"] += len(bs.pack(r) if stage_l2 else r)
        if e.l3:
            exp["l3"] += len(bs.pack(rec("int8", e.idx)[0]))
    stats = st.stats()
    assert exp["l2"] > 0 and exp["l3"] > 0
    comp = stats["compression"]
    assert comp["byte_stage"] == stage and comp["byte_stage_l2"] == stage_l2
    assert (comp["lz4_ratio"] is None) == (stage != "lz4")
    assert stats["bytes"]["l2"] == exp["l2"] and stats["bytes"]["l3"] == exp["l3"]
    assert stats["bytes"]["l1"] == st.residency.tables[s][0].resident * st.slot_bytes
    # values: each block reads back as its home tier's codec round trip
    K, V = st.gather(s, 0)
    for e in ents[:-1]:
        if e.slot is not None and not e.clean:
            continue
        name = host if e.l2 else "int8"
        r, kc, vc = rec(name, e.idx)
        sl = slice(e.idx * bt, (e.idx + 1) * bt)
        assert torch.equal(K[:, sl], kc.decode(kc.encode(k[:, sl])).half())
        assert torch.equal(V[:, sl], vc.decode(vc.encode(v[:, sl])).half())
    if order == "tier-then-compress":
        assert any(e.l2 for e in ents)  # full precision in L2 ...
        l2_block = next(e for e in ents if e.l2)
        sl = slice(l2_block.idx * bt, (l2_block.idx + 1) * bt)
        assert torch.equal(K[:, sl], k[:, sl])  # ... reads back exact
    ratio = stats["compression"]["l2_ratio"]
    assert (ratio > 1.5) if order == "compress-then-tier" else (ratio < 1.01)
    st.close()


def test_bad_store_config(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="disk_path"):
        make_store(None, disk_path=str(f / "sub"))
    with pytest.raises(ValueError, match="device_bytes"):
        make_store(None, device_bytes=100)
    # one sequence's L1: (2 layers x 4 hot blocks + 3 scratch slots) x 256-byte slots
    st = make_store(None, max_sequences=1, device_max_bytes=2816)
    st.add_sequence()
    with pytest.raises(MemoryError, match=r"need 5,632 bytes .*device_max_bytes=2,816"):
        st.add_sequence()
    with pytest.raises(ValueError, match="layer"):
        st.seq_len(0, 5)
    st.close()


def test_no_l3_and_full_l2_is_reported(rng):
    st = make_store(None, num_layers=1, device_tokens=8, host_bytes=4096)
    s = st.add_sequence()
    with pytest.raises(RuntimeError, match="host_bytes"):
        for _ in range(2000):
            k, v = random_chunk(rng)
            st.append(s, 0, k, v)
            st.end_step()
    st.close()


def test_drop_sequence_frees_every_tier(tmp_path, rng):
    st = make_store(tmp_path, num_layers=2, device_tokens=8, host_bytes=4096)
    a, b = st.add_sequence(), st.add_sequence()
    ref = Ref()
    for _ in range(600):
        s, layer = rng.choice([a, b]), rng.randrange(2)
        k, v = random_chunk(rng)
        st.append(s, layer, k, v)
        ref.add(s, layer, k, v)
        st.end_step()
    st.drop_sequence(a)
    check_invariants(st)
    assert not any(key.startswith(f"{a}/") for tier in (st.l1, st.l2, st.l3) for key in tier.keys())
    for layer in range(2):
        assert_gathers(st, ref, b, layer)
    st.close()


def test_hot_bytes_sizes_the_pool():
    slot = 2 * 2 * 4 * 8 * 2  # [2, kv_heads, block_tokens, head_dim] fp16
    st = make_store(None, num_layers=2, device_tokens=None, device_bytes=3 * slot * 2 * 4, max_sequences=4)
    assert st.hot_blocks == 3 and st.budget_tokens == 12
    st.close()


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nothing_lost_on_cuda(tmp_path, rng):
    """Side-stream swap-out, device decode on swap-in, prefetch: bit-exact with fp16."""
    st = make_store(tmp_path, num_layers=2, device_tokens=8, host_bytes=4096, device="cuda",
                    attention="sparse", budget_tokens=8, sink_tokens=0, window_tokens=0)
    ref = Ref()
    s = st.add_sequence()
    for it in range(800):
        layer = rng.randrange(2)
        k, v = random_chunk(rng)
        st.append(s, layer, k.cuda(), v.cuda())
        ref.add(s, layer, k, v)
        st.end_step()
        if it % 20 == 0 and st.seq_len(s, layer) > 8:
            sel = st.select(s, layer, torch.randn(4, 1, 8, device="cuda"))
            K, V, pos = st.gather_blocks(s, layer, sel)
            rk, rv = ref.kv(s, layer)
            assert K.is_cuda and torch.equal(K.cpu(), rk[:, pos.cpu()]) and torch.equal(V.cpu(), rv[:, pos.cpu()])
    check_invariants(st)
    for layer in range(2):
        K, V = st.gather(s, layer)
        rk, rv = ref.kv(s, layer)
        assert torch.equal(K.cpu(), rk) and torch.equal(V.cpu(), rv)
    st.close()


def test_wrong_prefetches_are_throttled(tmp_path):
    """A predictor whose prefetches go unused is cut down to probes; used ones are not."""
    st = make_store(tmp_path, num_layers=1, device_tokens=8, host_bytes=1 << 20, prefetch_blocks=4,
                    attention="sparse", budget_tokens=8, sink_tokens=0, window_tokens=0, prefetch=True)
    s = st.add_sequence()
    st.append(s, 0, torch.randn(2, 400, 8).half(), torch.randn(2, 400, 8).half())
    st.end_step()
    st.flush()
    t = st.residency.tables[s][0]
    cold = [e.idx for e in t.entries[:-1] if e.slot is None]
    assert len(cold) > 90
    for b in cold:  # every prefetch is pushed out unused by the next ones
        st.prefetcher.prefetch(t, [b], "next_layer")
    by = st.stats()["prefetch"]["by_source"]["next_layer"]
    assert by["throttled"] > 0 and by["precision"] == 0.0
    assert by["issued"] < len(cold) - by["throttled"] // 2
    # a predictor that is right keeps issuing
    for b in cold[:40]:
        st.prefetcher.prefetch(t, [b], "temporal")
        K, _, pos = st.gather_blocks(s, 0, [b])
        assert pos[0].item() == b * 4
    by = st.stats()["prefetch"]["by_source"]["temporal"]
    assert by["throttled"] == 0 and by["used"] == 40
    json.dumps(st.stats())
    st.close()


@pytest.mark.parametrize("stage", [{}, {"byte_stage": "zstd", "byte_stage_l2": True}], ids=["lz4", "zstd-l2"])
def test_export_blocks_reuses_stored_records(tmp_path, stage):
    """export_blocks returns disk-codec records: the stored bytes for blocks in L2/L3 (no second
    quantization), a fresh encoding for blocks only in L1, and the open block's tokens raw."""
    from kvtier.compress import get_codec
    from kvtier.store.blockrecord import pack_block, unpack_block

    bt, hd = 16, 32
    st = make_store(tmp_path, num_layers=1, block_tokens=bt, head_dim=hd, device_tokens=4 * bt,
                    host_bytes=16 << 10, codec="int4", policy="lru", **stage)
    s, k, v = _one_sequence(st, 20 * bt + 5, hd)
    kc = get_codec("int4", group_size=32, axis="channel")
    vc = get_codec("int4", group_size=32, axis="token")
    encoded = []
    orig = st.io.encode
    st.io.encode = lambda block, tier: encoded.append(tier) or orig(block, tier)
    recs, tail = st.export_blocks(s, 0)
    st.io.encode = orig
    assert len(recs) == 20 and torch.equal(tail, torch.stack((k[:, 20 * bt:], v[:, 20 * bt:])))
    ents = st.residency.tables[s][0].entries
    homes = {"l1": 0, "below": 0}
    for e, rec in zip(ents, recs):
        sl = slice(e.idx * bt, (e.idx + 1) * bt)
        assert rec == pack_block(kc.encode(k[:, sl]), vc.encode(v[:, sl]))  # one quantization only
        ek, ev = unpack_block(rec)
        assert ek.codec == ev.codec == "int4"
        homes["l1" if e.slot is not None and not (e.l2 or e.l3) else "below"] += 1
    assert homes["l1"] > 0 and homes["below"] > 0
    assert encoded == ["l3"] * homes["l1"]  # only the L1-only blocks were encoded
    # a sequence ending on a block boundary: the full last block is exported, the tail is empty
    s2 = st.add_sequence()
    st.append(s2, 0, k[:, :3 * bt], v[:, :3 * bt])
    recs, tail = st.export_blocks(s2, 0)
    assert len(recs) == 3 and tail.shape == (2, 2, 0, hd)
    st.close()


def test_a_closed_store_refuses_every_call_that_reads_or_writes_blocks(tmp_path):
    st = make_store(tmp_path)
    s = st.add_sequence()
    k = torch.randn(2, 9, 8).half()
    st.append(s, 0, k, k)
    st.close()
    st.close()  # twice is harmless
    one = k[:, :1]
    calls = {"append": lambda: st.append(s, 0, one, one), "gather": lambda: st.gather(s, 0),
             "gather_blocks": lambda: st.gather_blocks(s, 0, [0]), "gather_view": lambda: st.gather_view(s, 0, [0]),
             "select": lambda: st.select(s, 0, torch.randn(2, 1, 8).half()), "end_step": st.end_step,
             "observe": lambda: st.observe(s, 0, [0], torch.ones(1)), "export_blocks": lambda: st.export_blocks(s, 0)}
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match="KVStore is closed"):
            call()
    json.dumps(st.stats())  # what it last held stays readable


def test_append_refuses_bad_layers_and_non_float_tensors_and_stores_nothing():
    st = make_store(None)
    s = st.add_sequence()
    one = torch.randn(2, 1, 8).half()
    for layer in (-1, 2, True, 0.0, "0"):
        with pytest.raises(ValueError, match="layer must be"):
            st.append(s, layer, one, one)
        with pytest.raises(ValueError, match="layer must be"):
            st.gather(s, layer)
    with pytest.raises(ValueError, match="k and v must"):
        st.append(s, 0, torch.ones(2, 1, 8, dtype=torch.int64), torch.ones(2, 1, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="k and v must"):
        st.append(s, 0, [[0.0]], [[0.0]])
    assert st.seq_len(s, 0) == st.seq_len(s, 1) == 0
    st.append(s, 1, one, one)
    assert torch.equal(st.gather(s, 1)[0], one) and st.seq_len(s, 0) == 0
    st.close()


@pytest.mark.parametrize("codec", ["int8", "fp16"])
def test_non_finite_kv_is_refused_at_append_and_leaves_the_sequence_usable(codec):
    # found by the codec only when the block is evicted, on the swap-out worker, a NaN used to
    # fail a later, unrelated call and leave the sequence's table half-appended
    st = make_store(None, num_layers=1, device_tokens=8, host_bytes=1 << 20, codec=codec)
    s = st.add_sequence()
    good = torch.randn(2, 10, 8).half()
    st.append(s, 0, good, good)
    for bad in (float("nan"), float("inf")):
        k = torch.randn(2, 30, 8).half()
        k[1, 17, 3] = bad
        with pytest.raises(ValueError, match="finite"):
            st.append(s, 0, k, good[:, :1].expand(2, 30, 8))
        with pytest.raises(ValueError, match="finite"):
            st.append(s, 0, good[:, :1].expand(2, 30, 8), k)
    big = torch.full((2, 1, 8), 1e6)  # float32 KV beyond float16's range
    with pytest.raises(ValueError, match="finite"):
        st.append(s, 0, big, big)
    assert st.seq_len(s, 0) == 10
    more = torch.randn(2, 30, 8).half()
    st.append(s, 0, more, more)
    st.end_step()
    check_invariants(st)
    K, _ = st.gather(s, 0)
    assert K.shape[1] == 40 and torch.isfinite(K).all()
    st.close()
