"""The compiled CPU block scoring (kvtier/store/score_cpu.py) against the torch math of Selector.scores."""
import pytest
import torch

from kvtier.store import score_cpu
from tests.store.conftest import make_store

pytestmark = pytest.mark.skipif(not score_cpu.available(), reason="no C compiler: select() keeps the torch path")


def _torch_scores(q, digest, lo, hi, quest, scale):
    """The torch math of Selector.scores: q [kvh, R, hd], digest [kvh, cap, width] -> [hi - lo]."""
    d = digest[:, lo:hi].transpose(1, 2).float()  # [kvh, width, m]
    if quest:
        qq = torch.cat((q.clamp(min=0), q.clamp(max=0)), dim=-1)  # [kvh, R, 2*hd]
        return torch.bmm(qq, d).amax(dim=1).sum(dim=0)
    return torch.softmax(torch.bmm(q, d) * scale, dim=-1).amax(dim=(0, 1))


def _same_top(a, b, k):
    """Top-k sets agree, except across a tie (within float32 rounding) at the k-th place."""
    sa = set(torch.topk(a, k).indices.tolist())
    sb = set(torch.topk(b, k).indices.tolist())
    if sa == sb:
        return True
    kth = torch.sort(a, descending=True).values
    return bool((kth[k - 1] - kth[k]).abs() <= 4e-6 * kth.abs().max() + 1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quest", [False, True])
@pytest.mark.parametrize("kvh,r,hd,cap,lo,hi", [(3, 3, 64, 300, 2, 252), (2, 8, 12, 40, 0, 40),
                                                 (1, 1, 64, 9, 8, 9), (4, 5, 20, 64, 17, 50),
                                                 (2, 7, 32, 70, 1, 66)])
def test_scores_match_torch_on_random_data(dtype, quest, kvh, r, hd, cap, lo, hi):
    g = torch.Generator().manual_seed(kvh * 1000 + hd + lo)
    width = 2 * hd if quest else hd
    for trial in range(5):
        q = torch.randn(kvh, r, hd, generator=g) * (1 + 2 * trial)
        digest = torch.randn(kvh, cap, width, generator=g).to(dtype)
        scale = hd ** -0.5
        ref = _torch_scores(q, digest, lo, hi, quest, scale)
        got = score_cpu.block_scores(q, digest, lo, hi, quest, scale)
        assert got.shape == ref.shape and got.dtype == torch.float32
        # summation order differs: float32 rounding of the largest terms (quest sums cancel)
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-6 * float(ref.abs().max()) + 1e-7)
        m = hi - lo
        for k in {1, m // 4, m // 2, m - 1} - {0}:
            if k < m:
                assert _same_top(ref, got, k), (k, ref, got)


def test_extreme_logits_keep_the_softmax_finite():
    """A far-away block (logit gap > 87) scores ~0, never NaN; the best one scores 1."""
    q = torch.zeros(1, 1, 4)
    q[0, 0, 0] = 1.0
    digest = torch.zeros(1, 3, 4)
    digest[0, 0, 0] = 400.0
    digest[0, 1, 0] = -400.0
    got = score_cpu.block_scores(q, digest, 0, 3, False, 1.0)
    assert torch.isfinite(got).all()
    assert got[0] == pytest.approx(1.0) and got[1] < 1e-30 and got[2] < 1e-30


@pytest.mark.parametrize("digest_dtype", ["kv", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("score, digest_tokens", [("centroid", 4), ("quest", 4), ("centroid", 1), ("centroid", 2)])
def test_store_selection_same_with_and_without_the_compiled_path(dtype, score, digest_tokens, digest_dtype):
    """Also with sub-block centroids (digest_tokens < block_tokens): the C path scores every
    sub-block in one softmax and a block as its best part, as Selector.scores does; int4 (per
    channel over a block's centroids) only has sub-blocks."""
    bt, hd = 4, 16
    if digest_dtype == "int4" and (score != "centroid" or digest_tokens == bt):
        pytest.skip("int4 digests need centroid sub-blocks")
    stores = [make_store(None, num_layers=1, kv_heads=2, head_dim=hd, dtype=dtype, block_tokens=bt,
                         device_tokens=256 * bt, host_bytes=1 << 22, budget_tokens=24 * bt, sink_tokens=bt,
                         window_tokens=2 * bt, attention="sparse", select_score=score,
                         digest_tokens=digest_tokens, digest_dtype=digest_dtype) for _ in range(2)]
    assert stores[0].selector.compiled, "CPU store with a float32/bf16/int8 digest should take the compiled path"
    stores[1].selector.compiled = False  # the torch path
    g = torch.Generator().manual_seed(1)
    seqs = [st.add_sequence() for st in stores]
    k = torch.randn(2, 200 * bt + 1, hd, generator=g).to(dtype)
    for st, seq in zip(stores, seqs):
        st.append(seq, 0, k, k)
    for i in range(20):
        q = torch.randn(4, 1 + i % 3, hd, generator=g)  # q_len > 1: several query rows per head
        a, b = (st.select(seq, 0, q) for st, seq in zip(stores, seqs))
        assert a == b
    for st in stores:
        st.close()


def test_fp16_store_keeps_the_torch_path():
    st = make_store(None, attention="sparse", digest_dtype="kv")  # fp16 digests: no in-place read in C
    assert not st.selector.compiled
    st.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quest", [False, True])
def test_top_blocks_is_the_torch_topk(dtype, quest):
    g = torch.Generator().manual_seed(7)
    hd, lo, hi = 64, 3, 203
    width = 2 * hd if quest else hd
    for trial in range(10):
        q = torch.randn(3, 3, hd, generator=g)
        digest = torch.randn(3, 256, width, generator=g).to(dtype)
        ref = _torch_scores(q, digest, lo, hi, quest, hd ** -0.5)
        for k in (1, 7, 50, hi - lo):
            got = score_cpu.top_blocks(q, digest, lo, hi, quest, hd ** -0.5, k)
            assert got == sorted(got) and len(set(got)) == k
            if set(got) != set(torch.topk(ref, k).indices.tolist()):
                assert _same_top(ref, score_cpu.block_scores(q, digest, lo, hi, quest, hd ** -0.5), k)


def test_top_blocks_ties_go_to_the_lower_index_and_nan_ranks_last():
    q = torch.ones(1, 1, 8)
    digest = torch.zeros(1, 10, 8)
    digest[0, 6] = 1.0  # the best block; the other nine tie
    assert score_cpu.top_blocks(q, digest, 0, 10, False, 1.0, 3) == [0, 1, 6]
    quest = torch.zeros(1, 10, 16)  # max | min
    quest[0, 6, :8] = 1.0
    assert score_cpu.top_blocks(q, quest, 2, 10, True, 1.0, 2) == [0, 4]  # offsets from lo: rows 2 and 6
    nanq = torch.full((1, 1, 8), float("nan"))
    assert score_cpu.top_blocks(nanq, digest, 0, 10, False, 1.0, 4) == [0, 1, 2, 3]


@pytest.mark.parametrize("digest_dtype", ["kv", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("score", ["centroid", "quest"])
def test_scores_match_the_store_torch_path(dtype, score, digest_dtype):
    """Against Selector.scores itself (the specification), on a real digest table."""
    bt, hd = 4, 16
    st = make_store(None, num_layers=1, kv_heads=2, head_dim=hd, dtype=dtype, block_tokens=bt,
                    device_tokens=256 * bt, host_bytes=1 << 22, budget_tokens=24 * bt, sink_tokens=bt,
                    window_tokens=2 * bt, attention="sparse", select_score=score, digest_tokens=bt,
                    digest_dtype=digest_dtype)
    g = torch.Generator().manual_seed(3)
    seq = st.add_sequence()
    k = torch.randn(2, 100 * bt + 1, hd, generator=g).to(dtype)
    st.append(seq, 0, k, k)
    t = st.residency.table(seq, 0)
    for ql in (1, 3):
        q = torch.randn(4, ql, hd, generator=g)
        ref = st.selector.scores(t, q, 1, 97)
        got = score_cpu.block_scores(st.selector.query_rows(q), t.digest, 1, 97, score == "quest", hd ** -0.5,
                                  t.digest_scale)
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-6 * float(ref.abs().max()) + 1e-7)
    st.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [2, 4])
def test_top_blocks_with_sub_block_centroids_is_the_torch_spec(dtype, parts):
    g = torch.Generator().manual_seed(3)
    hd, lo, hi, kvh = 32, 2, 90, 3
    for trial in range(10):
        q = torch.randn(9, 1, hd, generator=g)
        digest = torch.randn(kvh, 128, parts * hd, generator=g).to(dtype)
        rows = digest[:, lo:hi].float().reshape(kvh, -1, hd)  # [kv_heads, m * parts, hd]
        s = torch.bmm(q.view(kvh, -1, hd), rows.transpose(1, 2)) * hd ** -0.5
        ref = torch.softmax(s, dim=-1).amax(dim=(0, 1)).view(-1, parts).amax(dim=1)  # [m]
        for k in (1, 5, 30, hi - lo):
            got = score_cpu.top_blocks(q, digest, lo, hi, False, hd ** -0.5, k, parts)
            assert got == sorted(got) and len(set(got)) == k
            want = set(torch.topk(ref, k).indices.tolist())
            if set(got) != want:  # only blocks whose scores tie to float32 rounding may differ
                kth = torch.topk(ref, k).values[-1]
                assert all(abs(ref[j] - kth) < 1e-6 for j in set(got) ^ want)


def _int8(x):
    """(codes, scales) of float rows x [kvh, cap, parts, sub] as the store keeps them, and their
    dequantized float32 rows [kvh, cap, parts * sub] (what the torch math scores)."""
    from kvtier.store.table import dequantize_rows, quantize_rows

    q, sc = quantize_rows(x)
    kvh, cap, parts, sub = x.shape
    return q.view(kvh, cap, parts * sub).contiguous(), sc.contiguous(), dequantize_rows(q, sc).view(kvh, cap, -1)


@pytest.mark.parametrize("quest", [False, True])
@pytest.mark.parametrize("kvh,r,hd,cap,lo,hi", [(3, 3, 64, 300, 2, 252), (2, 8, 12, 40, 0, 40), (1, 1, 64, 9, 8, 9),
                                                 (2, 7, 32, 70, 1, 66)])
def test_int8_scores_match_torch_on_the_dequantized_digest(quest, kvh, r, hd, cap, lo, hi):
    """The C scorer on int8 codes and per-row scales computes the torch math on codes * scale."""
    g = torch.Generator().manual_seed(kvh * 1000 + hd + lo + 1)
    width = 2 * hd if quest else hd
    for trial in range(5):
        q = torch.randn(kvh, r, hd, generator=g) * (1 + 2 * trial)
        # rows of very different magnitudes: a row's scale must be its own
        x = torch.randn(kvh, cap, 1, width, generator=g) * torch.rand(kvh, cap, 1, 1, generator=g).mul(10).exp()
        codes, sc, deq = _int8(x)
        ref = _torch_scores(q, deq, lo, hi, quest, hd ** -0.5)
        got = score_cpu.block_scores(q, codes, lo, hi, quest, hd ** -0.5, sc)
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-6 * float(ref.abs().max()) + 1e-7)
        m = hi - lo
        for k in {1, m // 4, m // 2, m - 1} - {0}:
            if k < m:
                assert _same_top(ref, got, k), (k, ref, got)
                top = score_cpu.top_blocks(q, codes, lo, hi, quest, hd ** -0.5, k, 1, sc)
                assert top == sorted(top) and len(set(top)) == k
                assert set(top) == set(torch.topk(got, k).indices.tolist()) or _same_top(ref, got, k)


@pytest.mark.parametrize("parts", [2, 8])
def test_int8_top_blocks_with_sub_block_centroids_is_the_torch_spec(parts):
    """One scale per sub-block centroid: rscale holds m * parts of them per head."""
    g = torch.Generator().manual_seed(11)
    hd, lo, hi, kvh = 32, 2, 90, 3
    for trial in range(10):
        q = torch.randn(9, 1, hd, generator=g)
        x = torch.randn(kvh, 128, parts, hd, generator=g) * torch.rand(kvh, 128, parts, 1, generator=g).mul(4).exp()
        codes, sc, deq = _int8(x)
        rows = deq[:, lo:hi].reshape(kvh, -1, hd)  # [kv_heads, m * parts, hd]
        s = torch.bmm(q.view(kvh, -1, hd), rows.transpose(1, 2)) * hd ** -0.5
        ref = torch.softmax(s, dim=-1).amax(dim=(0, 1)).view(-1, parts).amax(dim=1)  # [m]
        for k in (1, 5, 30, hi - lo):
            got = score_cpu.top_blocks(q, codes, lo, hi, False, hd ** -0.5, k, parts, sc)
            assert got == sorted(got) and len(set(got)) == k
            want = set(torch.topk(ref, k).indices.tolist())
            if set(got) != want:  # only blocks whose scores tie to float32 rounding may differ
                kth = torch.topk(ref, k).values[-1]
                assert all(abs(ref[j] - kth) < 1e-6 for j in set(got) ^ want)


def test_int8_digest_without_its_scales_is_refused():
    codes = torch.zeros(1, 4, 8, dtype=torch.int8)
    with pytest.raises(AssertionError, match="scales"):
        score_cpu.block_scores(torch.zeros(1, 1, 8), codes, 0, 4, False, 1.0)
    with pytest.raises(AssertionError, match="scales"):
        score_cpu.top_blocks(torch.zeros(1, 1, 8), codes, 0, 4, False, 1.0, 2, 1, torch.zeros(1, 4, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kvh,g,ql,hd,n", [(3, 3, 1, 64, 1021), (2, 7, 1, 64, 64), (1, 2, 3, 12, 9), (4, 1, 1, 32, 1)])
def test_key_mass_is_the_torch_mass(dtype, kvh, g, ql, hd, n):
    """H2O's per-key mass from the compiled pass equals attention_probs(wide=False) summed over
    heads and rows, on keys read in place from a strided L1-like run view."""
    from kvtier.hf.sparse import attention_probs, key_mass

    gen = torch.Generator().manual_seed(n + hd)
    pool = torch.randn(2, kvh, n + 40, hd, generator=gen).to(dtype)  # [plane, kv_heads, tokens, hd]
    keys = pool[0].narrow(1, 7, n).unsqueeze(0)  # [1, kv_heads, n, hd]: head stride > n * hd
    query = (3 * torch.randn(1, kvh * g, ql, hd, generator=gen)).to(dtype)
    got = score_cpu.key_mass(query, keys, 0.125)
    want = attention_probs(query, keys, None, 0.125, wide=False).sum(dim=(1, 2))[0]
    assert got is not None and got.shape == (n,) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6)
    assert torch.equal(key_mass(query, keys, None, 0.125)[0], got)  # sparse.py takes it without a mask
    mask = torch.ones(1, 1, ql, n, dtype=torch.bool)
    mask[..., 0] = False
    masked = key_mass(query, keys, mask, 0.125)  # a mask: the torch path
    torch.testing.assert_close(masked, attention_probs(query, keys, mask, 0.125, wide=False).sum(dim=(1, 2)))


def test_key_mass_declines_what_it_cannot_read():
    q = torch.randn(2, 4, 1, 16)
    assert score_cpu.key_mass(q, torch.randn(2, 2, 8, 16), 1.0) is None  # two batch rows
    assert score_cpu.key_mass(q[:1], torch.randn(1, 2, 8, 16).half(), 1.0) is None  # fp16 keys
    assert score_cpu.key_mass(q[:1], torch.randn(1, 2, 16, 8).transpose(2, 3), 1.0) is None  # strided rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kvh,g,hd,n", [(3, 3, 64, 1000), (2, 7, 64, 37), (1, 8, 128, 5), (4, 2, 24, 300)])
@pytest.mark.parametrize("with_rest", [False, True])
def test_decode_attend_is_attention_its_lse_mass_and_merge(dtype, kvh, g, hd, n, with_rest):
    """The fused decode pass against float64 attention over keys and values read in place from
    strided L1-like run views: the output (merged with an estimate when given, as merge_lse
    merges it), the exact part's log-sum-exp and H2O's per-key mass; R = g query heads per kv
    head covers both value passes (at most 4 rows, and the 8-row tiles)."""
    gen = torch.Generator().manual_seed(n + hd + g)
    pool = torch.randn(2, kvh, n + 40, hd, generator=gen).to(dtype)
    keys, values = (pool[i].narrow(1, 7, n).unsqueeze(0) for i in range(2))  # head stride > n * hd
    qh = kvh * g
    query = (3 * torch.randn(1, qh, 1, hd, generator=gen)).to(dtype)
    rest = None
    if with_rest:
        rest = (torch.randn(qh, 1, hd, generator=gen), torch.randn(qh, 1, generator=gen) + 2.0)
    got = score_cpu.decode_attend(query, keys, values, 0.125, True, rest)
    assert got is not None
    out, lse, mass = got
    assert out.shape == (1, 1, qh, hd) and out.dtype == dtype and lse.shape == (qh,) and mass.shape == (n,)
    q = query.double().reshape(kvh, g, hd)
    s = torch.einsum("hgd,hnd->hgn", q, keys[0].double()) * 0.125
    p = torch.softmax(s, -1)
    want = torch.einsum("hgn,hnd->hgd", p, values[0].double()).reshape(qh, hd)
    want_lse = torch.logsumexp(s, -1).reshape(qh)
    if with_rest:
        w = torch.sigmoid(want_lse - rest[1].double().reshape(qh))[:, None]
        want = w * want + (1 - w) * rest[0].double().reshape(qh, hd)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.reshape(qh, hd).double(), want, **tol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mass.double(), p.sum((0, 1)), rtol=1e-5, atol=1e-6)
    assert score_cpu.decode_attend(query, keys, values, 0.125, False, rest)[2] is None
    padded = score_cpu.decode_attend(query, keys, values, 0.125, True, rest, mass_len=n + 11)[2]
    assert padded.shape == (n + 11,) and torch.equal(padded[:n], mass) and not padded[n:].any()
    if dtype == torch.bfloat16:  # rounded once, from the float32 result
        f32 = score_cpu.decode_attend(query.float(), keys.float(), values.float(), 0.125, False, rest)[0]
        assert torch.equal(out, f32.to(dtype))


def test_decode_attend_declines_what_it_cannot_read():
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 8, 16)
    assert score_cpu.decode_attend(q, k, k, 1.0, False) is not None
    assert score_cpu.decode_attend(torch.randn(1, 4, 2, 16), k, k, 1.0, False) is None  # two queries
    assert score_cpu.decode_attend(q.half(), k.half(), k.half(), 1.0, False) is None  # float16
    assert score_cpu.decode_attend(q, k, k.bfloat16(), 1.0, False) is None  # mixed dtypes
    assert score_cpu.decode_attend(q, k, torch.randn(1, 2, 16, 8).transpose(2, 3), 1.0, False) is None  # strided rows
    assert score_cpu.decode_attend(q, k[:, :, :0], k[:, :, :0], 1.0, False) is None  # no keys
