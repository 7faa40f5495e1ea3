"""Key digests: kept only for sparse attention, only what ``select_score`` reads, in the KV dtype,
and counted in L1's bytes."""
import json

import pytest
import torch

from tests.store.conftest import make_store

KVH, HD, BT = 2, 8, 4


@pytest.mark.parametrize("score,width", [("centroid", HD), ("quest", 2 * HD)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_digest_bytes_are_counted_in_l1(score, width, dtype):
    st = make_store(None, num_layers=2, block_tokens=BT, hot_tokens=64, budget_tokens=16, dtype=dtype,
                    attention="sparse", select_score=score, prefetch=False)
    s = st.add_sequence()
    st.append(s, 0, torch.randn(KVH, 37, HD).to(dtype), torch.randn(KVH, 37, HD).to(dtype))  # 9 sealed + 1
    st.append(s, 1, torch.randn(KVH, 8, HD).to(dtype), torch.randn(KVH, 8, HD).to(dtype))    # 1 sealed + 1
    t = st.residency.tables[s][0]
    assert t.digest.dtype == dtype and tuple(t.digest.shape[::2]) == (KVH, width)
    elem = torch.empty((), dtype=dtype).element_size()
    want = (9 + 1) * KVH * width * elem
    stats = st.stats()
    assert stats["digest_bytes"] == want
    assert stats["digest_reserved_bytes"] >= want
    resident = stats["copies"]["l1"]
    assert stats["bytes"]["l1"] == resident * st.slot_bytes + want
    json.dumps(stats)
    st.close()


def test_centroid_digest_is_the_key_mean():
    st = make_store(None, num_layers=1, block_tokens=BT, hot_tokens=64, budget_tokens=16, dtype=torch.float32,
                    attention="sparse", select_score="centroid", prefetch=False)
    s = st.add_sequence()
    k = torch.randn(KVH, 9, HD)
    st.append(s, 0, k, k)
    t = st.residency.tables[s][0]
    assert torch.allclose(t.digest[:, :2], k[:, :8].view(KVH, 2, BT, HD).mean(2))
    st.close()


def test_quest_digest_is_max_then_min():
    st = make_store(None, num_layers=1, block_tokens=BT, hot_tokens=64, budget_tokens=16, dtype=torch.float16,
                    attention="sparse", select_score="quest", prefetch=False)
    s = st.add_sequence()
    k = torch.randn(KVH, 9, HD).half()
    st.append(s, 0, k, k)
    blocks = k[:, :8].view(KVH, 2, BT, HD)
    t = st.residency.tables[s][0]
    assert torch.equal(t.digest[:, :2, :HD], blocks.amax(2))
    assert torch.equal(t.digest[:, :2, HD:], blocks.amin(2))
    st.close()


def test_dense_mode_keeps_no_digests_and_select_names_attention():
    st = make_store(None, num_layers=1, block_tokens=BT, hot_tokens=64, attention="dense")
    s = st.add_sequence()
    st.append(s, 0, torch.randn(KVH, 40, HD).half(), torch.randn(KVH, 40, HD).half())
    assert st.residency.tables[s][0].digest is None
    stats = st.stats()
    assert stats["digest_bytes"] == 0 and stats["bytes"]["l1"] == stats["copies"]["l1"] * st.slot_bytes
    with pytest.raises(ValueError, match="attention"):
        st.select(s, 0, torch.randn(4, 1, HD))
    st.close()


def test_sub_block_centroids_are_the_sub_block_means_and_counted():
    st = make_store(None, num_layers=1, block_tokens=BT, hot_tokens=64, budget_tokens=16, dtype=torch.float32,
                    attention="sparse", select_score="centroid", digest_tokens=2, prefetch=False)
    s = st.add_sequence()
    k = torch.randn(KVH, 9, HD)
    st.append(s, 0, k, k)
    t = st.residency.tables[s][0]
    subs = k[:, :8].view(KVH, 2, 2, BT // 2, HD).mean(3)  # [kv_heads, block, sub-block, hd]
    assert torch.allclose(t.digest[:, :2], subs.reshape(KVH, 2, 2 * HD))
    assert st.stats()["digest_bytes"] == 2 * KVH * 2 * HD * 4
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
        st = make_store(None, num_layers=1, kv_heads=kvh, head_dim=hd, block_tokens=bt, hot_tokens=6 * bt,
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
        KVTierConfig(block_tokens=BT, hot_tokens=64, attention="sparse", **kw)
