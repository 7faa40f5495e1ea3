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
    t = st._tables[s][0]
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
    t = st._tables[s][0]
    assert torch.allclose(t.digest[:, :2], k[:, :8].view(KVH, 2, BT, HD).mean(2))
    st.close()


def test_quest_digest_is_max_then_min():
    st = make_store(None, num_layers=1, block_tokens=BT, hot_tokens=64, budget_tokens=16, dtype=torch.float16,
                    attention="sparse", select_score="quest", prefetch=False)
    s = st.add_sequence()
    k = torch.randn(KVH, 9, HD).half()
    st.append(s, 0, k, k)
    blocks = k[:, :8].view(KVH, 2, BT, HD)
    t = st._tables[s][0]
    assert torch.equal(t.digest[:, :2, :HD], blocks.amax(2))
    assert torch.equal(t.digest[:, :2, HD:], blocks.amin(2))
    st.close()


def test_dense_mode_keeps_no_digests_and_select_names_attention():
    st = make_store(None, num_layers=1, block_tokens=BT, hot_tokens=64, attention="dense")
    s = st.add_sequence()
    st.append(s, 0, torch.randn(KVH, 40, HD).half(), torch.randn(KVH, 40, HD).half())
    assert st._tables[s][0].digest is None
    stats = st.stats()
    assert stats["digest_bytes"] == 0 and stats["bytes"]["l1"] == stats["copies"]["l1"] * st.slot_bytes
    with pytest.raises(ValueError, match="attention"):
        st.select(s, 0, torch.randn(4, 1, HD))
    st.close()
