"""Digests: kept only for sparse attention, only what ``select_score`` reads (and the value means
``rest_attention="estimate"`` reads), in the KV dtype or as int8 rows with a float32 scale each,
and counted in L1's bytes."""
import json

import pytest
import torch

from tests.store.conftest import make_store

KVH, HD, BT = 2, 8, 4


@pytest.mark.parametrize("score,rest,width,vwidth", [("centroid", "estimate", HD, HD), ("centroid", "drop", HD, 0),
                                                    ("quest", "drop", 2 * HD, 0)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_digest_bytes_are_counted_in_l1(score, rest, width, vwidth, dtype):
    st = make_store(None, num_layers=2, block_tokens=BT, device_tokens=64, budget_tokens=16, dtype=dtype,
                    attention="sparse", select_score=score, digest_tokens=BT, digest_dtype="kv", prefetch=False,
                    rest_attention=rest)
    s = st.add_sequence()
    st.append(s, 0, torch.randn(KVH, 37, HD).to(dtype), torch.randn(KVH, 37, HD).to(dtype))  # 9 sealed + 1
    st.append(s, 1, torch.randn(KVH, 8, HD).to(dtype), torch.randn(KVH, 8, HD).to(dtype))    # 1 sealed + 1
    t = st.residency.tables[s][0]
    assert t.digest.dtype == dtype and tuple(t.digest.shape[::2]) == (KVH, width)
    elem = torch.empty((), dtype=dtype).element_size()
    assert (t.vdigest is None) == (vwidth == 0)
    want = (9 + 1) * KVH * (width + vwidth) * elem  # key summaries and value means of 9 + 1 sealed blocks
    stats = st.stats()
    assert stats["digest_bytes"] == want
    assert stats["digest_reserved_bytes"] >= want
    resident = stats["copies"]["l1"]
    assert stats["bytes"]["l1"] == resident * st.slot_bytes + want
    json.dumps(stats)
    st.close()


def test_centroid_digest_is_the_key_mean():
    st = make_store(None, num_layers=1, block_tokens=BT, device_tokens=64, budget_tokens=16, dtype=torch.float32,
                    attention="sparse", select_score="centroid", digest_tokens=BT, digest_dtype="kv", prefetch=False)
    s = st.add_sequence()
    k, v = torch.randn(KVH, 9, HD), torch.randn(KVH, 9, HD)
    st.append(s, 0, k, v)
    t = st.residency.tables[s][0]
    assert torch.allclose(t.digest[:, :2], k[:, :8].view(KVH, 2, BT, HD).mean(2))
    assert torch.allclose(t.vdigest[:, :2], v[:, :8].view(KVH, 2, BT, HD).mean(2))  # value_digest_tokens = BT
    st.close()


def test_quest_digest_is_max_then_min():
    st = make_store(None, num_layers=1, block_tokens=BT, device_tokens=64, budget_tokens=16, dtype=torch.float16,
                    attention="sparse", select_score="quest", digest_dtype="kv", prefetch=False)
    s = st.add_sequence()
    k = torch.randn(KVH, 9, HD).half()
    st.append(s, 0, k, k)
    blocks = k[:, :8].view(KVH, 2, BT, HD)
    t = st.residency.tables[s][0]
    assert torch.equal(t.digest[:, :2, :HD], blocks.amax(2))
    assert torch.equal(t.digest[:, :2, HD:], blocks.amin(2))
    st.close()


def test_dense_mode_keeps_no_digests_and_select_names_attention():
    st = make_store(None, num_layers=1, block_tokens=BT, device_tokens=64, attention="dense")
    s = st.add_sequence()
    st.append(s, 0, torch.randn(KVH, 40, HD).half(), torch.randn(KVH, 40, HD).half())
    assert st.residency.tables[s][0].digest is None
    stats = st.stats()
    assert stats["digest_bytes"] == 0 and stats["bytes"]["l1"] == stats["copies"]["l1"] * st.slot_bytes
    with pytest.raises(ValueError, match="attention"):
        st.select(s, 0, torch.randn(4, 1, HD))
    st.close()


def test_sub_block_centroids_are_the_sub_block_means_and_counted():
    st = make_store(None, num_layers=1, block_tokens=BT, device_tokens=64, budget_tokens=16, dtype=torch.float32,
                    attention="sparse", select_score="centroid", digest_tokens=2, digest_dtype="kv", prefetch=False)
    s = st.add_sequence()
    k = torch.randn(KVH, 9, HD)
    st.append(s, 0, k, k)
    t = st.residency.tables[s][0]
    subs = k[:, :8].view(KVH, 2, 2, BT // 2, HD).mean(3)  # [kv_heads, block, sub-block, hd]
    assert torch.allclose(t.digest[:, :2], subs.reshape(KVH, 2, 2 * HD))
    assert st.cfg.value_digest_tokens == BT  # one value mean a block (default 4 = BT)
    assert st.stats()["digest_bytes"] == 2 * KVH * (2 + 1) * HD * 4  # per block: 2 centroids, 1 value mean
    st.close()


def test_sub_block_centroids_find_one_matching_key_a_block_mean_hides():
    """One key aligned with the query among 15 opposed ones: its block's mean scores lowest, the
    4-token sub-block holding it scores highest."""
    bt, hd, kvh = 16, 8, 1
    q = torch.zeros(kvh, 1, hd)
    q[0, 0, 0] = 4.0
    keys = torch.zeros(kvh, 6 * bt, hd)
    keys[0, :, 1] = 1.0                    # filler blocks: orthogonal to q (score 0)
    target = 2 * bt                        # block 2
    keys[0, target:target + bt, 0] = -0.5  # its keys oppose q ...
    keys[0, target + 5, 0] = 6.0           # ... but one (in sub-block 1) matches it strongly
    picks = {}
    for dt in (bt, 4):
        st = make_store(None, num_layers=1, kv_heads=kvh, head_dim=hd, block_tokens=bt, device_tokens=6 * bt,
                        budget_tokens=2 * bt, dtype=torch.float32, attention="sparse", select_score="centroid",
                        digest_tokens=dt, sink_tokens=0, window_tokens=0, prefetch=False)
        s = st.add_sequence()
        st.append(s, 0, keys, keys)
        picks[dt] = st.select(s, 0, q, 2 * bt)
        st.close()
    assert picks[4] == [2]
    assert picks[bt] != [2]


@pytest.mark.parametrize("kw,match", [(dict(digest_tokens=3), "digest_tokens must divide block_tokens"),
                                      (dict(digest_tokens=0), "digest_tokens must be an int >= 1"),
                                      (dict(digest_tokens=2, select_score="quest"), "unless select_score")])
def test_bad_digest_tokens_name_the_field(kw, match):
    from kvtier.config import KVTierConfig
    with pytest.raises(ValueError, match=match):
        KVTierConfig(block_tokens=BT, device_tokens=64, attention="sparse", **kw)


def test_int8_rows_round_trip_within_half_a_step():
    from kvtier.store.table import dequantize_rows, quantize_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 64, generator=g) * torch.logspace(-3, 2, 50).view(1, 50, 1)  # row scales 1e-3..1e2
    x[0, 7, 5] = 300.0  # an outlier channel sets its row's step
    x[1, 3] = 0.0       # an all-zero row
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    back = dequantize_rows(q, scale)
    err = (back - x).abs()
    bound = x.abs().amax(dim=-1, keepdim=True) / 254
    assert (err <= bound * (1 + 1e-5) + 1e-12).all()
    assert torch.equal(back[1, 3], torch.zeros(64)) and scale[1, 3] == 0
    assert (q.abs().amax(dim=-1)[scale > 0] == 127).all()  # every nonzero row uses the full range
    # bf16 input is read as float32 (no intermediate rounding of the scale)
    qb, sb = quantize_rows(x.bfloat16())
    assert sb.dtype == torch.float32


@pytest.mark.parametrize("score,parts", [("centroid", 1), ("centroid", 2), ("quest", 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_digest_is_the_quantized_summary_and_its_bytes_are_counted(score, parts, dtype):
    from kvtier.store.table import dequantize_rows

    st = make_store(None, num_layers=1, block_tokens=BT, device_tokens=64, budget_tokens=16, dtype=dtype,
                    attention="sparse", select_score=score, digest_tokens=BT // parts, digest_dtype="int8",
                    prefetch=False)
    s = st.add_sequence()
    k = torch.randn(KVH, 4 * BT + 1, HD).to(dtype)
    v = torch.randn(KVH, 4 * BT + 1, HD).to(dtype)
    st.append(s, 0, k, v)
    t = st.residency.tables[s][0]
    assert t.digest.dtype == torch.int8 and t.digest_scale.shape[::2] == (KVH, parts)
    blocks = k[:, :4 * BT].float().view(KVH, 4, parts, BT // parts, HD)
    if score == "centroid":
        want = blocks.mean(3)                                                     # [kvh, block, part, hd]
    else:
        want = torch.cat((blocks.amax(3), blocks.amin(3)), dim=-1)                # [kvh, block, 1, 2 * hd]
    # quantized from the float32 summary (not from a KV-dtype rounding of it): half a step
    got = dequantize_rows(t.digest[:, :4].view(*want.shape).contiguous(), t.digest_scale[:, :4])
    step = want.abs().amax(dim=-1, keepdim=True) / 127
    assert ((got - want).abs() <= step * (0.5 + 1e-5)).all()
    width = (2 if score == "quest" else parts) * HD
    per_block = KVH * (width + 4 * parts)  # int8 codes + one float32 scale per centroid (quest row)
    if score == "centroid":  # and a value mean of the block (value_digest_tokens = BT), int8 the same way
        vwant = v[:, :4 * BT].float().view(KVH, 4, 1, BT, HD).mean(3)
        vgot = dequantize_rows(t.vdigest[:, :4].view(*vwant.shape).contiguous(), t.vdigest_scale[:, :4])
        assert ((vgot - vwant).abs() <= vwant.abs().amax(dim=-1, keepdim=True) / 127 * (0.5 + 1e-5)).all()
        per_block += KVH * (HD + 4)
    else:
        assert t.vdigest is None
    stats = st.stats()
    assert stats["digest_bytes"] == 4 * per_block
    assert stats["digest_reserved_bytes"] >= 4 * per_block
    assert stats["bytes"]["l1"] == stats["copies"]["l1"] * st.slot_bytes + 4 * per_block
    st.close()


def _dequantized_scores(t, q, lo, hi, quest):
    """Scores of blocks [lo, hi) on the float32 dequantized digest: the math the torch path ran
    before it scored the codes in place (it kept that dequantized range)."""
    from kvtier.store.table import dequantize_rows

    kvh, _, width = t.digest.shape
    p = t.digest_parts
    deq = dequantize_rows(t.digest[:, lo:hi].reshape(kvh, -1, p, width // p), t.digest_scale[:, lo:hi])
    rows = deq.reshape(kvh, -1, width // p)  # [kv_heads, m * parts, sub-row]
    q = q.float().reshape(kvh, -1, HD)  # [kv_heads, G*q_len, hd]
    if quest:
        qq = torch.cat((q.clamp(min=0), q.clamp(max=0)), dim=-1)
        return torch.bmm(qq, rows.transpose(1, 2)).amax(dim=1).sum(dim=0)
    s = torch.bmm(q, rows.transpose(1, 2)) * HD ** -0.5
    return torch.softmax(s, dim=-1).amax(dim=(0, 1)).view(-1, p).amax(dim=1)


@pytest.mark.parametrize("score,parts", [("centroid", 1), ("centroid", 4), ("quest", 1)])
def test_int8_torch_scoring_reads_the_codes_in_place_and_selects_as_the_dequantized_digest(score, parts):
    """The torch path (CUDA, or a CPU without a C compiler) scores int8 codes and multiplies by
    each row's scale: what it keeps between steps are views of the table (no dequantized
    float32 range, 4x the codes' bytes, per layer), and it selects the blocks the dequantized
    digest selects."""
    bt, n = 8, 120
    st = make_store(None, num_layers=1, block_tokens=bt, device_tokens=128 * bt, host_bytes=1 << 22,
                    budget_tokens=24 * bt, sink_tokens=bt, window_tokens=2 * bt, dtype=torch.float32,
                    attention="sparse", select_score=score, digest_tokens=bt // parts, digest_dtype="int8",
                    prefetch=False, select_heads="shared")  # the shared top-k of the scores below
    st.selector.compiled = False
    g = torch.Generator().manual_seed(5)
    s = st.add_sequence()
    # blocks of very different magnitudes: each row's scale matters
    k = torch.randn(KVH, n * bt + 1, HD, generator=g) * torch.rand(1, n * bt + 1, 1, generator=g).mul(3).exp()
    st.append(s, 0, k, k)
    t = st.residency.tables[s][0]
    lo, hi = 1, n - 2  # the candidates between the sink block and the window (n sealed blocks)
    for i in range(10):
        q = torch.randn(4, 1 + i % 2, HD, generator=g)
        got = st.selector.scores(t, q, lo, hi)
        ref = _dequantized_scores(t, q, lo, hi, score == "quest")
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
        for kk in (1, 10, 20, 60):
            assert set(torch.topk(got, kk).indices.tolist()) == set(torch.topk(ref, kk).indices.tolist())
        sel = st.select(s, 0, q)
        top = torch.topk(ref, 24 - 1 - 3).indices + lo  # the budget less the open, sink and window blocks
        assert sel == [0] + sorted(top.tolist()) + [n - 2, n - 1]
    view, scale = t.digest_t(lo, hi)
    assert view.dtype == torch.int8 and view.untyped_storage().data_ptr() == t.digest.untyped_storage().data_ptr()
    assert scale.untyped_storage().data_ptr() == t.digest_scale.untyped_storage().data_ptr()
    assert scale.shape == (KVH, 1, (hi - lo) * parts)
    st.close()


def test_int8_digest_is_smaller_than_the_kv_dtype_one_at_twice_the_resolution():
    """The default 2-token int8 centroids cost about what 4-token bf16 ones did (head_dim + 4
    bytes against 2 * head_dim per centroid)."""
    hd = 64
    sizes = {}
    for dd, dt in (("kv", 4), ("int8", 2)):
        st = make_store(None, num_layers=1, head_dim=hd, block_tokens=16, device_tokens=256, budget_tokens=64, host_bytes=1 << 20,
                        dtype=torch.bfloat16, attention="sparse", digest_tokens=dt, digest_dtype=dd, prefetch=False,
                        rest_attention="drop")  # key centroids only
        s = st.add_sequence()
        st.append(s, 0, torch.randn(KVH, 161, hd).bfloat16(), torch.randn(KVH, 161, hd).bfloat16())
        sizes[dd] = st.stats()["digest_bytes"]
        st.close()
    assert sizes["int8"] == 10 * KVH * 8 * (hd + 4) and sizes["kv"] == 10 * KVH * 4 * 2 * hd
    assert sizes["int8"] <= 1.07 * sizes["kv"]


@pytest.mark.parametrize("digest_dtype", ["int8", "int4"])
def test_fork_copies_quantized_digests(digest_dtype):
    st = make_store(None, num_layers=1, block_tokens=BT, device_tokens=64, budget_tokens=16, dtype=torch.float32,
                    attention="sparse", digest_tokens=1, digest_dtype=digest_dtype, prefetch=False)
    s = st.add_sequence()
    k = torch.randn(KVH, 6 * BT + 1, HD)
    st.append(s, 0, k, k)
    f = st.fork_sequence(s)
    a, b = st.residency.tables[s][0], st.residency.tables[f][0]
    for x, y in ((a.digest, b.digest), (a.digest_scale, b.digest_scale), (a.vdigest, b.vdigest),
                 (a.vdigest_scale, b.vdigest_scale)):
        assert torch.equal(x[:, :6], y[:, :6]) and x.data_ptr() != y.data_ptr()
    q = torch.randn(4, 1, HD)
    assert st.select(s, 0, q) == st.select(f, 0, q)
    st.close()


def test_bad_digest_dtype_names_the_field():
    from kvtier.config import KVTierConfig
    with pytest.raises(ValueError, match="digest_dtype"):
        KVTierConfig(attention="sparse", digest_dtype="int2")
    # int4's scale and zero are per channel over a block's centroids: it needs several a block
    with pytest.raises(ValueError, match="digest_dtype='int4' needs select_score='centroid'"):
        KVTierConfig(attention="sparse", digest_dtype="int4", select_score="quest")
    with pytest.raises(ValueError, match="digest_tokens < block_tokens"):
        KVTierConfig(attention="sparse", digest_dtype="int4", block_tokens=16, digest_tokens=16)


def test_int4_channels_quantize_within_half_a_step_and_pack_two_a_byte():
    from kvtier.store.table import dequantize_channels, quantize_channels

    g = torch.Generator().manual_seed(2)
    # channels with offsets far larger than their spread (as RoPE'd keys have): per channel, not per row
    x = torch.randn(3, 16, 64, generator=g) + torch.randn(3, 1, 64, generator=g) * 20
    x[1, :, 5] = 7.25  # a constant channel: scale 0, every code 0, the value the zero
    packed, sz = quantize_channels(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 16 * 32) and sz.dtype == torch.float16
    assert sz.shape == (3, 128)
    got = dequantize_channels(packed, sz, 16)
    scale, zero = sz.float().split(64, dim=-1)
    # half a step, plus float16's rounding of the zero (relative 2^-11)
    bound = scale.unsqueeze(1) / 2 + zero.abs().unsqueeze(1) * 2 ** -11 + 1e-6
    assert ((got - x).abs() <= bound).all()
    assert got[1, :, 5].eq(7.25).all()
    # the block's 16 * 64 codes (row-major): the first half in the low nibbles, the second in the high
    codes = torch.cat((packed & 15, packed >> 4), dim=-1).view(3, 16, 64)
    want = torch.round((x - zero.unsqueeze(1)) / torch.where(scale > 0, scale, 1.0).unsqueeze(1)).clamp(0, 15)
    assert torch.equal(codes.float(), want)
    assert codes.min() == 0 and codes.max() == 15  # each channel's min and max are on the grid's ends


def test_int4_channels_clamp_to_float16_instead_of_overflowing():
    from kvtier.store.table import dequantize_channels, quantize_channels

    x = torch.zeros(1, 4, 8)
    x[0, 0, 0], x[0, 1, 0] = -1e6, 1e6
    packed, sz = quantize_channels(x)
    assert torch.isfinite(sz.float()).all()
    assert torch.isfinite(dequantize_channels(packed, sz, 4)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_digest_is_the_quantized_summary_and_its_bytes_are_counted(dtype):
    from kvtier.store.table import dequantize_channels, dequantize_rows

    parts, bt = 4, 8
    st = make_store(None, num_layers=1, block_tokens=bt, device_tokens=128, budget_tokens=32, dtype=dtype,
                    attention="sparse", digest_tokens=bt // parts, digest_dtype="int4", prefetch=False)
    s = st.add_sequence()
    k = torch.randn(KVH, 4 * bt + 1, HD).to(dtype) + 5
    v = torch.randn(KVH, 4 * bt + 1, HD).to(dtype)
    st.append(s, 0, k, v)
    t = st.residency.tables[s][0]
    assert t.digest.dtype == torch.uint8 and t.digest.shape[::2] == (KVH, parts * HD // 2)
    assert t.digest_scale.dtype == torch.float16 and t.digest_scale.shape[::2] == (KVH, 2 * HD)
    want = k[:, :4 * bt].float().view(KVH, 4, parts, bt // parts, HD).mean(3)  # [kvh, block, part, hd]
    got = dequantize_channels(t.digest[:, :4], t.digest_scale[:, :4], parts)
    scale, zero = t.digest_scale[:, :4].float().split(HD, dim=-1)
    assert ((got - want).abs() <= scale.unsqueeze(2) / 2 + zero.abs().unsqueeze(2) * 2 ** -11 + 1e-6).all()
    torch.testing.assert_close(t.key_centroids(torch.arange(4)), got)
    # the torch path scores the same dequantized centroids
    view, none = t.digest_t(1, 3)
    assert none is None and torch.equal(view, got[:, 1:3].reshape(KVH, -1, HD).transpose(1, 2))
    # value means stay int8 rows
    vp = t.value_parts
    vwant = v[:, :4 * bt].float().view(KVH, 4, vp, bt // vp, HD).mean(3)
    assert t.vdigest.dtype == torch.int8
    vgot = dequantize_rows(t.vdigest[:, :4].view(*vwant.shape).contiguous(), t.vdigest_scale[:, :4])
    assert ((vgot - vwant).abs() <= vwant.abs().amax(dim=-1, keepdim=True) / 127 * (0.5 + 1e-5)).all()
    per_block = KVH * (parts * HD // 2 + 2 * HD * 2 + vp * (HD + 4))
    assert st.layout.digest_row_bytes == t.digest_row_bytes() == per_block
    stats = st.stats()
    assert stats["digest_bytes"] == 4 * per_block
    assert stats["bytes"]["l1"] == stats["copies"]["l1"] * st.slot_bytes + 4 * per_block
    st.close()


def test_int4_key_rows_cost_less_than_int8_ones():
    """A key row per token at Qwen2.5-0.5B's head_dim: 48 bytes a row and kv head (32 of codes,
    16 of the block's float16 scales and zeros spread over its 16 rows) against int8's 68."""
    from kvtier.store.table import INT4, digest_row_bytes

    int8 = digest_row_bytes(2, 64, "centroid", 16, torch.int8)
    int4 = digest_row_bytes(2, 64, "centroid", 16, INT4)
    assert (int8, int4) == (2 * 16 * 68, 2 * 16 * 48)


def test_int4_with_an_odd_head_dim_is_refused_when_set_and_int8_when_derived():
    st = make_store(None, num_layers=1, head_dim=7, block_tokens=BT, device_tokens=64, budget_tokens=16,
                    dtype=torch.float32, attention="sparse", digest_tokens=1, prefetch=False)
    assert st.layout.digest_dtype == torch.int8
    s = st.add_sequence()
    k = torch.randn(KVH, 6 * BT + 1, 7)
    st.append(s, 0, k, k)
    assert st.residency.tables[s][0].digest.dtype == torch.int8 and len(st.select(s, 0, torch.randn(4, 1, 7))) > 0
    st.close()
    with pytest.raises(ValueError, match="digest_dtype='int4' needs an even head_dim"):
        make_store(None, num_layers=1, head_dim=7, block_tokens=BT, device_tokens=64, budget_tokens=16,
                   dtype=torch.float32, attention="sparse", digest_tokens=1, digest_dtype="int4", prefetch=False)
