"""Per-kv-head selection (``select_heads="per_head"``): each kv head's ranking fills the
query-chosen slots in turn, so a block that only one kv head needs is not lost to blocks the other
heads score higher; the compiled path (csrc/score.c) agrees with the torch one (select.round_robin)."""
import pytest
import torch

from kvtier.config import KVTierConfig
from kvtier.store import score_cpu
from kvtier.store.select import round_robin
from tests.store.conftest import make_store

BT, HD = 4, 8


def test_round_robin_takes_each_heads_next_best_in_turn():
    s = torch.tensor([[5.0, 4.0, 3.0, 0.0, 0.0],
                      [0.0, 0.0, 0.0, 1.0, 2.0]])
    assert round_robin(s, 1) == [0]          # head 0 first
    assert round_robin(s, 2) == [0, 4]       # then head 1's best
    assert round_robin(s, 3) == [0, 1, 4]    # then head 0's next
    assert round_robin(s, 4) == [0, 1, 3, 4]
    # a block both heads rank first is taken once; head 1 moves on to its next best
    both = torch.tensor([[5.0, 4.0, 0.0, 0.0], [5.0, 0.0, 0.0, 4.0]])
    assert round_robin(both, 2) == [0, 3]
    # ties go to the lower index, NaN ranks last
    ties = torch.tensor([[1.0, 1.0, float("nan"), 1.0]])
    assert round_robin(ties, 3) == [0, 1, 3]
    with pytest.raises(ValueError, match="k must be"):
        round_robin(s, 6)


def _crafted_store(heads: str, compiled: bool):
    """60 sealed blocks; kv head 0's query matches blocks 10-14 strongly (its softmax mass split
    five ways, 0.33 down to 0.10), kv head 1's only block 30, weakly (0.07 against 56 others):
    under the shared score (best head's probability) block 30 ranks below all five of head 0's."""
    st = make_store(None, num_layers=1, kv_heads=2, head_dim=HD, dtype=torch.float32, block_tokens=BT,
                    device_tokens=64 * BT, host_bytes=1 << 20, budget_tokens=7 * BT, sink_tokens=BT,
                    window_tokens=2 * BT, attention="sparse", digest_tokens=BT, digest_dtype="kv",
                    select_heads=heads)
    assert st.selector.compiled  # float32 digests on the CPU: the C path
    st.selector.compiled = compiled
    seq = st.add_sequence()
    k = torch.zeros(2, 60 * BT + 1, HD)
    for b in range(10, 15):  # distinct strengths: torch's topk orders ties arbitrarily
        k[0, b * BT:(b + 1) * BT, 0] = 4.0 - 0.1 * (b - 10)
    k[1, 30 * BT:(30 + 1) * BT, 1] = 0.5
    st.append(seq, 0, k, k)
    q = torch.zeros(2, 1, HD)  # one query head per kv head
    q[0, 0, 0] = 8.0
    q[1, 0, 1] = 8.0
    return st, seq, q


@pytest.mark.parametrize("compiled", [True, False])
def test_one_heads_top_block_is_kept_per_head_and_lost_shared(compiled):
    # budget: sink block 0, window blocks 58-59, the open block, and 3 query-chosen blocks
    st, seq, q = _crafted_store("shared", compiled)
    shared = st.select(seq, 0, q)
    st.close()
    st, seq, q = _crafted_store("per_head", compiled)
    per_head = st.select(seq, 0, q)
    st.close()
    assert shared == [0, 10, 11, 12, 58, 59]          # head 0's blocks only
    assert per_head == [0, 10, 11, 30, 58, 59]        # head 0's best, head 1's best, head 0's next


@pytest.mark.skipif(not score_cpu.available(), reason="no C compiler: select() keeps the torch path")
@pytest.mark.parametrize("digest_dtype", ["kv", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("score, digest_tokens", [("centroid", 2), ("centroid", 4), ("quest", 4)])
def test_compiled_per_head_selection_is_the_torch_one(dtype, score, digest_tokens, digest_dtype):
    if digest_dtype == "int4" and (score != "centroid" or digest_tokens == BT):
        pytest.skip("int4 digests need centroid sub-blocks")
    stores = [make_store(None, num_layers=1, kv_heads=3, head_dim=16, dtype=dtype, block_tokens=BT,
                         device_tokens=256 * BT, host_bytes=1 << 22, budget_tokens=24 * BT, sink_tokens=BT,
                         window_tokens=2 * BT, attention="sparse", select_score=score,
                         digest_tokens=digest_tokens, digest_dtype=digest_dtype, select_heads="per_head")
              for _ in range(2)]
    assert stores[0].selector.compiled
    stores[1].selector.compiled = False
    g = torch.Generator().manual_seed(5)
    seqs = [st.add_sequence() for st in stores]
    k = torch.randn(3, 200 * BT + 1, 16, generator=g).to(dtype)
    for st, seq in zip(stores, seqs):
        st.append(seq, 0, k, k)
    differ = 0
    for i in range(20):
        q = torch.randn(6, 1 + i % 3, 16, generator=g)
        a, b = (st.select(seq, 0, q) for st, seq in zip(stores, seqs))
        assert len(a) == len(b) == 24 - 1 and a == sorted(set(a))
        differ += a != b
    # C and torch sum in different orders: a per-head ranking may swap two blocks whose scores
    # tie to float32 rounding, which changes a round-robin pick; on random keys that is rare
    assert differ <= 1
    for st in stores:
        st.close()


@pytest.mark.skipif(not score_cpu.available(), reason="no C compiler: select() keeps the torch path")
@pytest.mark.parametrize("quest, parts", [(False, 1), (False, 2), (True, 1)])
def test_top_blocks_per_head_is_round_robin_of_the_head_scores(quest, parts):
    g = torch.Generator().manual_seed(11)
    kvh, hd, lo, hi = 2, 32, 3, 83
    m = hi - lo
    for trial in range(10):
        q = torch.randn(kvh * 7, 1, hd, generator=g)  # 7 query heads per kv head (Qwen2.5-0.5B's GQA)
        digest = torch.randn(kvh, 96, (2 * hd if quest else hd) * parts, generator=g)
        qr, d = q.view(kvh, -1, hd), digest[:, lo:hi]
        if quest:
            qq = torch.cat((qr.clamp(min=0), qr.clamp(max=0)), dim=-1)
            head = torch.bmm(qq, d.transpose(1, 2)).amax(dim=1)
        else:
            s = torch.bmm(qr, d.reshape(kvh, m * parts, hd).transpose(1, 2)) * hd ** -0.5
            head = torch.softmax(s, dim=-1).amax(dim=1).view(kvh, m, parts).amax(dim=2)
        for k in (1, 2, 9, 40, m):
            got = score_cpu.top_blocks(q, digest, lo, hi, quest, hd ** -0.5, k, parts, per_head=True)
            assert got == round_robin(head, k)


def test_select_heads_is_checked():
    with pytest.raises(ValueError, match="select_heads"):
        KVTierConfig(attention="sparse", select_heads="each")
