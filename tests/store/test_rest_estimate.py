"""rest_attention="estimate": the blocks a sparse step does not select are attended from their
digests (key centroids, value means) and merged with the exact part by log-sum-exp."""
import math

import pytest
import torch

from kvtier.config import KVTierConfig
from kvtier.hf.sparse import budgeted_attention
from kvtier.store import score_cpu
from tests.store.conftest import make_store

KVH, HD, BT = 2, 8, 4


def _store(dtype=torch.float32, **kw):
    base = dict(num_layers=1, block_tokens=BT, device_tokens=64, budget_tokens=16, dtype=dtype,
                attention="sparse", codec="fp32" if dtype == torch.float32 else "fp16", host_bytes=1 << 20,
                prefetch=False, sink_tokens=BT, window_tokens=BT)
    base.update(kw)
    return make_store(None, **base)


def _full_attention(q, k, v, scaling):
    """softmax(q K^T) V over every token: q [q_heads, 1, hd], k, v [kv_heads, T, hd] -> [q_heads, hd]."""
    g = q.shape[0] // k.shape[0]
    kk, vv = k.float().repeat_interleave(g, 0), v.float().repeat_interleave(g, 0)
    p = torch.softmax(q.float() @ kk.transpose(1, 2) * scaling, dim=-1)  # [q_heads, 1, T]
    return (p @ vv)[:, 0]


class _SdpaModule(torch.nn.Module):
    """What transformers' SDPA attention reads off a model's attention module."""
    is_causal = True

    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups


@pytest.mark.parametrize("qheads", [2, 6])
@pytest.mark.parametrize("kernel", ["float32", "sdpa"])
def test_with_one_token_centroids_the_estimate_completes_exact_attention(qheads, kernel):
    """digest_tokens = value_digest_tokens = 1 in the KV dtype: each centroid is one key and its
    value, so selected blocks (exact) + the estimate (every other token) is full attention; with
    the model's kernel ("sdpa") the exact part comes from flash attention with its log-sum-exp."""
    torch.manual_seed(0)
    st = _store(digest_tokens=1, value_digest_tokens=1, digest_dtype="kv")
    s = st.add_sequence()
    T = 15 * BT + 3
    k, v = torch.randn(KVH, T, HD), torch.randn(KVH, T, HD)
    st.append(s, 0, k, v)
    q = torch.randn(1, qheads, 1, HD) * 2
    scaling = HD ** -0.5
    module = _SdpaModule(qheads // KVH) if kernel == "sdpa" else None
    r = budgeted_attention(st, [s], 0, q, None, scaling, 16, observe=False, sdpa_module=module)
    assert r.selected_blocks < 15  # the budget left most blocks to the estimate
    want = _full_attention(q[0], k, v, scaling)
    assert torch.allclose(r.out[0, 0].float(), want, atol=1e-5, rtol=1e-4)
    st.close()


def test_drop_attends_only_the_selected_blocks_and_estimate_differs():
    torch.manual_seed(1)
    outs = {}
    for rest in ("drop", "estimate"):
        st = _store(rest_attention=rest)
        s = st.add_sequence()
        g = torch.Generator().manual_seed(3)
        k, v = torch.randn(KVH, 63, HD, generator=g), torch.randn(KVH, 63, HD, generator=g)
        st.append(s, 0, k, v)
        q = torch.randn(1, 4, 1, HD, generator=g)
        outs[rest] = budgeted_attention(st, [s], 0, q, None, HD ** -0.5, 16, observe=False).out
        st.close()
    assert not torch.allclose(outs["drop"], outs["estimate"])


def test_a_budget_covering_the_context_leaves_nothing_to_estimate():
    st = _store()
    s = st.add_sequence()
    st.append(s, 0, torch.randn(KVH, 10, HD), torch.randn(KVH, 10, HD))
    sel = st.select(s, 0, torch.randn(4, 1, HD), 16)  # every sealed block
    assert st.estimate_rest(s, 0, torch.randn(4, 1, HD), sel, 0.3) is None
    st.close()


def test_blocks_with_a_hidden_token_are_left_out():
    """The step's mask hides a token (padding): its block is not estimated, the others are."""
    torch.manual_seed(2)
    st = _store(digest_tokens=1, value_digest_tokens=1, digest_dtype="kv", sink_tokens=0, window_tokens=0)
    s = st.add_sequence()
    T = 8 * BT + 1
    k, v = torch.randn(KVH, T, HD), torch.randn(KVH, T, HD)
    st.append(s, 0, k, v)
    q = torch.randn(4, 1, HD)
    visible = torch.ones(T, dtype=torch.bool)
    visible[1] = False  # block 0
    chosen = [5, 6, 7, 8]
    out, lse = st.estimate_rest(s, 0, q, chosen, HD ** -0.5, visible)
    rest = torch.arange(BT, 5 * BT)  # blocks 1..4: block 0 has the hidden token
    g = 2
    logits = (q @ k[:, rest].repeat_interleave(g, 0).transpose(1, 2)) * HD ** -0.5  # [4, 1, n]
    assert torch.allclose(lse, torch.logsumexp(logits, -1), atol=1e-5)
    want = torch.softmax(logits, -1) @ v[:, rest].repeat_interleave(g, 0)
    assert torch.allclose(out, want, atol=1e-5)
    st.close()


@pytest.mark.skipif(not score_cpu.available(), reason="no C compiler: the torch path only")
@pytest.mark.parametrize("dtype,digest_dtype", [(torch.float32, "int8"), (torch.float32, "kv"),
                                                (torch.bfloat16, "kv"), (torch.bfloat16, "int8"),
                                                (torch.float32, "int4"), (torch.bfloat16, "int4")])
@pytest.mark.parametrize("bt,dt,vt", [(16, 2, 4), (16, 2, 2), (16, 4, 16), (4, 1, 4), (8, 8, 8)])
def test_compiled_estimate_matches_the_torch_specification(dtype, digest_dtype, bt, dt, vt):
    if digest_dtype == "int4" and dt == bt:
        pytest.skip("int4 digests need centroid sub-blocks")
    g = torch.Generator().manual_seed(bt * 100 + dt * 10 + vt)
    hd, kvh = 64, 2
    st = make_store(None, num_layers=1, kv_heads=kvh, head_dim=hd, block_tokens=bt, device_tokens=8 * bt,
                    budget_tokens=4 * bt, dtype=dtype, attention="sparse", codec="fp16" if dtype != torch.float32
                    else "fp32", host_bytes=4 << 20, prefetch=False, digest_tokens=dt, value_digest_tokens=vt,
                    digest_dtype=digest_dtype)
    s = st.add_sequence()
    T = 37 * bt + 5
    st.append(s, 0, (torch.randn(kvh, T, hd, generator=g) * 3).to(dtype), torch.randn(kvh, T, hd, generator=g).to(dtype))
    sel = st.selector
    t = st.residency.tables[s][0]
    assert sel.compiled
    for trial in range(4):
        q = (torch.randn(7 * kvh, 1, hd, generator=g) * (1 + trial)).to(dtype)
        chosen = sorted(torch.randperm(37, generator=g)[: 3 + 5 * trial].tolist()) + [37]
        visible = None if trial < 2 else torch.rand(T, generator=g) > 0.02
        got = sel.rest_estimate(t, q, chosen, 0.125, visible)
        sel.compiled = False
        want = sel.rest_estimate(t, q, chosen, 0.125, visible)
        sel.compiled = True
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.allclose(got[1], want[1], atol=1e-4, rtol=1e-5), (got[1] - want[1]).abs().max()
            assert torch.allclose(got[0], want[0], atol=1e-4, rtol=1e-4), (got[0] - want[0]).abs().max()
    st.close()


def test_estimate_is_the_specification_math():
    """Selector.rest_estimate (torch path) against the formula written out: each centroid a key
    with logit + log(digest_tokens), the value of its value sub-block's mean."""
    g = torch.Generator().manual_seed(5)
    st = _store(block_tokens=8, device_tokens=64, budget_tokens=32, digest_tokens=2, value_digest_tokens=4,
                digest_dtype="kv", sink_tokens=8, window_tokens=8)
    st.selector.compiled = False
    s = st.add_sequence()
    T = 12 * 8 + 1
    k, v = torch.randn(KVH, T, HD, generator=g), torch.randn(KVH, T, HD, generator=g)
    st.append(s, 0, k, v)
    q = torch.randn(4, 1, HD, generator=g)
    chosen = [0, 3, 11, 12]
    out, lse = st.estimate_rest(s, 0, q, chosen, 0.4)
    rest = [b for b in range(12) if b not in chosen]
    keys = torch.cat([k[:, b * 8:(b + 1) * 8].reshape(KVH, 4, 2, HD).mean(2) for b in rest], 1)  # [kvh, 32, hd]
    vals = torch.cat([v[:, b * 8:(b + 1) * 8].reshape(KVH, 2, 4, HD).mean(2).repeat_interleave(2, 1)
                      for b in rest], 1)
    logits = q @ keys.repeat_interleave(2, 0).transpose(1, 2) * 0.4 + math.log(2)  # [4, 1, 32]
    assert torch.allclose(lse, torch.logsumexp(logits, -1), atol=1e-5)
    assert torch.allclose(out, torch.softmax(logits, -1) @ vals.repeat_interleave(2, 0), atol=1e-5)
    st.close()


def test_dense_and_drop_stores_refuse_estimate_rest_by_name():
    st = _store(rest_attention="drop")
    s = st.add_sequence()
    st.append(s, 0, torch.randn(KVH, 9, HD), torch.randn(KVH, 9, HD))
    with pytest.raises(ValueError, match="rest_attention='estimate'"):
        st.estimate_rest(s, 0, torch.randn(4, 1, HD), [0], 0.3)
    assert st.residency.tables[s][0].vdigest is None
    st.close()


@pytest.mark.parametrize("kw,match", [
    (dict(select_score="quest", rest_attention="estimate"), "needs select_score='centroid'"),
    (dict(rest_attention="drop", value_digest_tokens=4), "only for rest_attention='estimate'"),
    (dict(digest_tokens=2, value_digest_tokens=3), "multiple of digest_tokens"),
    (dict(digest_tokens=4, value_digest_tokens=2), "multiple of digest_tokens"),
    (dict(value_digest_tokens=32), "value_digest_tokens must be an int"),
    (dict(rest_attention="approx"), "rest_attention must be"),
])
def test_bad_rest_settings_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        KVTierConfig(block_tokens=16, device_tokens=64, attention="sparse", **kw)


def test_defaults_estimate_with_centroids_and_follow_the_score():
    cfg = KVTierConfig(device_tokens=64, attention="sparse")
    assert (cfg.rest_attention, cfg.digest_tokens, cfg.value_digest_tokens) == ("estimate", 1, 4)
    import dataclasses
    q = dataclasses.replace(cfg, select_score="quest")
    assert q.rest_attention == "drop" and q.value_digest_tokens is None
    # 4 does not divide 6: the largest multiple of digest_tokens up to 4 that does
    assert KVTierConfig(device_tokens=66, attention="sparse", block_tokens=6).value_digest_tokens == 3
    assert KVTierConfig(device_tokens=66, attention="sparse", block_tokens=6, digest_tokens=2).value_digest_tokens == 2
    assert KVTierConfig(device_tokens=64, attention="sparse", digest_tokens=8).value_digest_tokens == 8  # 4 is no multiple of 8


@pytest.mark.skipif(not score_cpu.available(), reason="no C compiler: the torch path only")
@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("digest_dtype,dtype", [("int8", torch.float32), ("kv", torch.bfloat16),
                                                ("int4", torch.bfloat16)])
@pytest.mark.parametrize("bt,dt,vt", [(16, 2, 4), (8, 1, 8), (4, 4, 4)])
def test_the_scorer_estimates_what_the_specification_does(per_head, digest_dtype, dtype, bt, dt, vt):
    """select_with_rest on the compiled path (the estimate from the scorer's own logits) against
    select + rest_estimate on the torch path: the same blocks, the same estimate."""
    if digest_dtype == "int4" and dt == bt:
        pytest.skip("int4 digests need centroid sub-blocks")
    g = torch.Generator().manual_seed(bt + dt + vt + per_head)
    hd, kvh = 64, 2
    st = make_store(None, num_layers=1, kv_heads=kvh, head_dim=hd, block_tokens=bt, device_tokens=8 * bt,
                    budget_tokens=6 * bt, dtype=dtype, attention="sparse", codec="fp32" if dtype == torch.float32
                    else "fp16", host_bytes=4 << 20, prefetch=False, digest_tokens=dt, value_digest_tokens=vt,
                    digest_dtype=digest_dtype, select_heads="per_head" if per_head else "shared",
                    sink_tokens=bt, window_tokens=bt)
    s = st.add_sequence()
    T = 41 * bt + 3
    st.append(s, 0, (torch.randn(kvh, T, hd, generator=g) * 2).to(dtype), torch.randn(kvh, T, hd, generator=g).to(dtype))
    t = st.residency.tables[s][0]
    scaling = hd ** -0.5
    for trial in range(3):
        q = (torch.randn(7 * kvh, 1, hd, generator=g) * (1 + trial)).to(dtype)
        sel, est = st.select_with_rest(s, 0, q, 6 * bt, scaling)
        st.selector.compiled = False
        want_sel = st.selector.select(t, q, 6 * bt)
        want = st.selector.rest_estimate(t, q, want_sel, scaling)
        st.selector.compiled = True
        assert sel == want_sel
        assert torch.allclose(est[1], want[1], atol=1e-4, rtol=1e-5)
        assert torch.allclose(est[0], want[0], atol=1e-4, rtol=1e-4)
    st.close()


@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("digest_dtype", ["int8", "int4", "kv"])
@pytest.mark.parametrize("padded", [False, True])
def test_the_torch_path_reads_the_digest_once_a_step(per_head, digest_dtype, padded, monkeypatch):
    """select_with_rest without the compiled scorer (the math CUDA runs): the estimate takes the
    blocks left out from the selection's logits, never scoring the digest again, and gives the
    blocks and estimate that select + rest_estimate give on their own; with a padding mask too."""
    g = torch.Generator().manual_seed(len(digest_dtype) + 2 * per_head + padded)
    bt, dt, hd, kvh = 16, 2, 64, 2
    st = make_store(None, num_layers=1, kv_heads=kvh, head_dim=hd, block_tokens=bt, device_tokens=8 * bt,
                    budget_tokens=6 * bt, dtype=torch.float32, attention="sparse", codec="fp32",
                    host_bytes=4 << 20, prefetch=False, digest_tokens=dt, value_digest_tokens=4,
                    digest_dtype=digest_dtype, select_heads="per_head" if per_head else "shared",
                    sink_tokens=bt, window_tokens=bt)
    sel = st.selector
    sel.compiled = False
    s = st.add_sequence()
    T = 41 * bt + 3
    st.append(s, 0, torch.randn(kvh, T, hd, generator=g) * 2, torch.randn(kvh, T, hd, generator=g))
    t = st.residency.tables[s][0]
    visible = None
    if padded:
        visible = torch.ones(T, dtype=torch.bool)
        visible[: 3 * bt + 5] = False  # blocks 0-3 hold padding: never estimated
    scaling = hd ** -0.5
    reads = []
    for name in ("key_centroids", "digest_t"):
        real = getattr(type(t), name)
        monkeypatch.setattr(type(t), name, lambda self, *a, _real=real, _n=name: reads.append(_n) or _real(self, *a))
    for trial in range(4):
        q = torch.randn(7 * kvh, 1, hd, generator=g) * (1 + trial)
        reads.clear()
        got_sel, got = sel.select_with_rest(t, q, 6 * bt, scaling, visible)
        assert reads == ["digest_t"]  # the selection's range, once; no key centroids
        want_sel = sel.select(t, q, 6 * bt)
        want = sel.rest_estimate(t, q, want_sel, scaling, visible)  # the digest read afresh
        assert "key_centroids" in reads
        assert got_sel == want_sel and len(got_sel) < 41
        assert torch.allclose(got[1], want[1], atol=1e-5, rtol=1e-5)
        assert torch.allclose(got[0], want[0], atol=1e-5, rtol=1e-5)
    # another scale than the scorer's: the estimate scores the digest itself
    q = torch.randn(7 * kvh, 1, hd, generator=g)
    reads.clear()
    got_sel, got = sel.select_with_rest(t, q, 6 * bt, 0.5 * scaling, visible)
    assert "key_centroids" in reads
    want = sel.rest_estimate(t, q, got_sel, 0.5 * scaling, visible)
    assert torch.allclose(got[1], want[1], atol=1e-6) and torch.allclose(got[0], want[0], atol=1e-6)
    st.close()


def test_a_step_with_padding_estimates_only_the_visible_blocks():
    """A left-padded row through budgeted_attention: the blocks holding padding are left out of
    the estimate (the mask's hidden tokens never reach the output)."""
    torch.manual_seed(4)
    st = _store(digest_tokens=1, value_digest_tokens=1, digest_dtype="kv", sink_tokens=0, window_tokens=BT)
    s = st.add_sequence()
    T = 12 * BT + 1
    k, v = torch.randn(KVH, T, HD), torch.randn(KVH, T, HD)
    st.append(s, 0, k, v)
    q = torch.randn(1, 4, 1, HD)
    mask = torch.ones(1, 1, 1, T, dtype=torch.bool)
    mask[..., : BT + 2] = False  # padding: block 0 and part of block 1
    r = budgeted_attention(st, [s], 0, q, mask, HD ** -0.5, 16, observe=False)
    # with one-token centroids the estimate is exact: the result is full attention over the
    # visible tokens of every block without padding, plus the selected blocks' visible tokens
    sel = st.select(s, 0, q[0], 16)
    keep = [p for p in range(T) if mask[0, 0, 0, p] and (p // BT >= 2 or p // BT in sel or p >= 12 * BT)]
    want = _full_attention(q[0], k[:, keep], v[:, keep], HD ** -0.5)
    assert torch.allclose(r.out[0, 0].float(), want, atol=1e-5, rtol=1e-4)
    st.close()


@pytest.mark.skipif(not score_cpu.available(), reason="no C compiler: the torch path only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_compiled_merge_matches_the_torch_merge(dtype, strided, monkeypatch):
    """score_cpu.merge_rest (a decode step's merge, in place) against with_rest's torch math."""
    from kvtier.hf import sparse
    g = torch.Generator().manual_seed(7 + strided)
    kvh, qh, n, hd = 2, 14, 37, 64
    query = (torch.randn(1, qh, 1, hd, generator=g) * 2).to(dtype)
    keys = torch.randn(1, kvh, n + 5 if strided else n, hd, generator=g).to(dtype)
    if strided:
        keys = keys[:, :, 2:2 + n]  # a run of the L1 region: rows contiguous, heads apart
    out = torch.randn(1, 1, qh, hd, generator=g).to(dtype)
    rest = (torch.randn(qh, 1, hd, generator=g), torch.randn(qh, 1, generator=g) * 3)
    rest[1][3] = -math.inf  # a head with nothing left to estimate keeps the exact part
    got = sparse.with_rest(query, keys, None, 0.125, [rest], out.clone())
    monkeypatch.setattr(score_cpu, "merge_rest", lambda *a: False)
    want = sparse.with_rest(query, keys, None, 0.125, [rest], out.clone())
    assert got.dtype == want.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(got[0, 0, 3], out[0, 0, 3])


def test_a_batch_estimates_each_row_as_it_would_alone():
    """Two rows of different lengths (padded in the batch, so the torch merge runs): each row's
    output equals the same row attended alone (the compiled merge)."""
    torch.manual_seed(8)
    st = _store(max_sequences=2, device_tokens=64)
    a, b = st.add_sequence(), st.add_sequence()
    st.append(a, 0, torch.randn(KVH, 61, HD), torch.randn(KVH, 61, HD))
    st.append(b, 0, torch.randn(KVH, 45, HD), torch.randn(KVH, 45, HD))
    q = torch.randn(2, 4, 1, HD)
    both = budgeted_attention(st, [a, b], 0, q, None, HD ** -0.5, 16, observe=False).out
    for row, seq in enumerate((a, b)):
        alone = budgeted_attention(st, [seq], 0, q[row:row + 1], None, HD ** -0.5, 16, observe=False).out
        assert torch.allclose(both[row], alone[0], atol=1e-5, rtol=1e-5)
    st.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_lse_is_sdpa_and_its_log_sum_exp(dtype):
    from kvtier.hf.attention import base_attention, decode_attention_lse
    g = torch.Generator().manual_seed(11)
    kvh, qh, n, hd = 2, 14, 53, 64
    q = torch.randn(1, qh, 1, hd, generator=g).to(dtype)
    kv = torch.randn(2, 1, kvh, n + 7, hd, generator=g).to(dtype)
    k, v = kv[0, :, :, 3:3 + n], kv[1, :, :, 3:3 + n]  # strided, as a view of L1
    mod = _SdpaModule(qh // kvh)
    out, lse = decode_attention_lse(mod, q, k, v, 0.125)
    want = base_attention(mod, q, k, v, None, scaling=0.125)[0]
    assert out.shape == want.shape == (1, 1, qh, hd) and out.dtype == dtype and lse.dtype == torch.float32
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(out.float(), want.float(), atol=tol, rtol=tol)
    logits = torch.einsum("hgd,hnd->hgn", q.float().view(kvh, qh // kvh, hd), k[0].float()) * 0.125
    assert torch.allclose(lse, torch.logsumexp(logits, -1).reshape(qh), atol=1e-4, rtol=1e-5)
    # not SDPA's call: the caller takes the model's own attention
    eager = _SdpaModule(qh // kvh)
    eager.config = type("C", (), {"_attn_implementation": "kvtier_eager"})()
    assert decode_attention_lse(eager, q, k, v, 0.125) is None
    assert decode_attention_lse(mod, q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1),
                                v.expand(2, -1, -1, -1), 0.125) is None
    assert decode_attention_lse(mod, q.expand(-1, -1, 2, -1), k, v, 0.125) is None


@pytest.mark.parametrize("rest", ["estimate", "drop"])
def test_only_a_step_that_leaves_blocks_out_leaves_the_models_kernel(rest, monkeypatch):
    """A budget covering the context must see SDPA's own call (token identity with
    DynamicCache); one that leaves blocks out takes the fused compiled pass (or, without a
    compiler, the kernel with the log-sum-exp)."""
    from kvtier.hf import sparse
    calls = []
    for name in ("decode_attention_lse", "decode_attention_fused"):
        real = getattr(sparse, name)
        monkeypatch.setattr(sparse, name, lambda *a, _real=real: calls.append(1) or _real(*a))
    for budget, want in ((64, 0), (16, 1)):
        st = _store(rest_attention=rest)
        s = st.add_sequence()
        st.append(s, 0, torch.randn(KVH, 45, HD), torch.randn(KVH, 45, HD))
        calls.clear()
        r = budgeted_attention(st, [s], 0, torch.randn(1, 4, 1, HD), None, HD ** -0.5, budget,
                               observe=False, sdpa_module=_SdpaModule(2))
        assert len(calls) == want, (budget, r.selected_blocks)
        st.close()


@pytest.mark.skipif(not score_cpu.available(), reason="no C compiler: the torch path only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_merge_with_a_known_lse_matches_torch(dtype):
    from kvtier.hf import sparse
    g = torch.Generator().manual_seed(5)
    qh, hd = 14, 64
    out = torch.randn(1, 1, qh, hd, generator=g).to(dtype)
    lse = torch.randn(qh, generator=g) * 3
    rest = (torch.randn(qh, 1, hd, generator=g), torch.randn(qh, 1, generator=g) * 3)
    rest[1][5] = -math.inf  # nothing left to estimate for this head
    got = out.clone()
    assert score_cpu.merge_lse(lse, rest[0], rest[1], got)
    want = sparse.merge_with_lse(lse.view(1, 1, -1), rest, out)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(got[0, 0, 5], out[0, 0, 5])
    assert not score_cpu.merge_lse(lse[:3], rest[0], rest[1], out.clone())  # shapes that do not fit


@pytest.mark.skipif(not score_cpu.available(), reason="no C compiler: the torch path only")
@pytest.mark.parametrize("rest", ["estimate", "drop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_step_is_the_flash_kernel_step(rest, dtype, monkeypatch):
    """A step that leaves blocks out gives, through the fused pass, the output and H2O mass of
    the flash kernel + merge + key_mass path it replaces (to rounding)."""
    from kvtier.hf import sparse
    st = _store(rest_attention=rest, dtype=dtype)
    s = st.add_sequence()
    g = torch.Generator().manual_seed(3)
    st.append(s, 0, torch.randn(KVH, 45, HD, generator=g).to(dtype), torch.randn(KVH, 45, HD, generator=g).to(dtype))
    q = torch.randn(1, 4, 1, HD, generator=g).to(dtype)
    fused = budgeted_attention(st, [s], 0, q, None, HD ** -0.5, 16, observe=True, sdpa_module=_SdpaModule(2))
    monkeypatch.setattr(sparse, "decode_attention_fused", lambda *a: None)
    flash = budgeted_attention(st, [s], 0, q, None, HD ** -0.5, 16, observe=True, sdpa_module=_SdpaModule(2))
    st.close()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fused.out.float(), flash.out.float(), **tol)
    assert [o[2] for o in fused.observed] == [o[2] for o in flash.observed]
    for a, b in zip(fused.observed, flash.observed):
        torch.testing.assert_close(a[3], b[3], rtol=1e-5, atol=1e-6)
