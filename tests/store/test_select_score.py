"""Block ranking for sparse attention: the centroid score and Quest's bound, on constructed keys."""
import pytest
import torch

from tests.store.conftest import make_store

HD = 8


def _fill(store, seq, blocks, bt):
    """Append ``blocks`` (each [kv_heads, bt, HD] keys; values zero) plus one open token."""
    for k in blocks:
        store.append(seq, 0, k, torch.zeros_like(k))
    store.append(seq, 0, torch.zeros(2, 1, HD, dtype=torch.float16), torch.zeros(2, 1, HD, dtype=torch.float16))


@pytest.mark.parametrize("score", ["centroid", "quest"])
def test_block_aligned_with_query_is_chosen(tmp_path, score):
    bt = 4
    store = make_store(tmp_path, block_tokens=bt, hot_tokens=8 * bt, budget_tokens=2 * bt, sink_tokens=0,
                       window_tokens=0, attention="sparse", select_score=score)
    seq = store.add_sequence()
    g = torch.Generator().manual_seed(0)
    blocks = [(torch.randn(2, bt, HD, generator=g) * 0.1).half() for _ in range(6)]
    blocks[3][1, :, 0] = 4.0  # only kv head 1, channel 0: a block one head needs
    _fill(store, seq, blocks, bt)
    q = torch.zeros(4, 1, HD)  # 2 query heads per kv head
    q[2:, 0, 0] = 3.0
    assert store.select(seq, 0, q, 2 * bt) == [3]
    store.close()


def test_centroid_is_not_fooled_by_one_outlier_token(tmp_path):
    """Quest's bound rewards a block for one extreme channel value of any token; the centroid
    ranks by the block's typical key, which is what attention mass follows."""
    bt = 8
    scores = {}
    for score in ("centroid", "quest"):
        store = make_store(tmp_path / score, block_tokens=bt, hot_tokens=8 * bt, budget_tokens=2 * bt,
                           sink_tokens=0, window_tokens=0, attention="sparse", select_score=score, digest_tokens=bt)
        seq = store.add_sequence()
        typical = torch.zeros(2, bt, HD).half()
        typical[:, :, 0] = 1.0          # every token moderately aligned with the query
        outlier = torch.zeros(2, bt, HD).half()
        outlier[:, 0, 0] = 3.0          # one token strongly aligned, the rest not at all
        outlier[:, 1:, 0] = -1.0
        _fill(store, seq, [outlier, typical], bt)
        q = torch.zeros(4, 1, HD)
        q[:, 0, 0] = 1.0
        scores[score] = store.select(seq, 0, q, 2 * bt)
        store.close()
    assert scores["centroid"] == [1]
    assert scores["quest"] == [0]


def test_bad_select_score_names_the_field():
    from kvtier.config import KVTierConfig

    with pytest.raises(ValueError, match="select_score"):
        KVTierConfig(select_score="oracle")


@pytest.mark.parametrize("successors, expected", [(False, [1, 3, 5, 7]), (True, [1, 2, 3, 4])])
def test_successors_take_the_block_after_each_best(tmp_path, successors, expected):
    """A copy that runs past the end of a matching block continues in the next one, whose own
    keys need not match the query: with ``select_successors`` half the slots follow the best."""
    bt = 4
    store = make_store(tmp_path, block_tokens=bt, hot_tokens=16 * bt, budget_tokens=5 * bt, sink_tokens=0,
                       window_tokens=0, attention="sparse", select_successors=successors)
    seq = store.add_sequence()
    blocks = [torch.zeros(2, bt, HD).half() for _ in range(10)]
    for b, strength in ((1, 4.0), (3, 3.0), (5, 2.0), (7, 1.5)):  # ranked 1 > 3 > 5 > 7, the rest 0
        blocks[b][:, :, 0] = strength
    _fill(store, seq, blocks, bt)
    q = torch.zeros(4, 1, HD)
    q[:, 0, 0] = 1.0
    assert store.select(seq, 0, q, 5 * bt) == expected
    store.close()


def test_successors_fill_slots_a_successor_already_holds(tmp_path):
    # the best two are adjacent: 2's successor is 3, itself among the best; the freed slot goes
    # to the next best (6), then the successors of the best two are 3 and 4
    bt = 4
    store = make_store(tmp_path, block_tokens=bt, hot_tokens=16 * bt, budget_tokens=5 * bt, sink_tokens=0,
                       window_tokens=0, attention="sparse", select_successors=True)
    seq = store.add_sequence()
    blocks = [torch.zeros(2, bt, HD).half() for _ in range(10)]
    for b, strength in ((2, 4.0), (3, 3.0), (6, 2.0)):
        blocks[b][:, :, 0] = strength
    _fill(store, seq, blocks, bt)
    q = torch.zeros(4, 1, HD)
    q[:, 0, 0] = 1.0
    assert store.select(seq, 0, q, 5 * bt) == [2, 3, 4, 6]
    store.close()


def test_successors_with_an_odd_slot_count(tmp_path):
    # 5 slots: the best two, their successors, and the third best
    bt = 4
    store = make_store(tmp_path, block_tokens=bt, hot_tokens=16 * bt, budget_tokens=6 * bt, sink_tokens=0,
                       window_tokens=0, attention="sparse", select_successors=True)
    seq = store.add_sequence()
    blocks = [torch.zeros(2, bt, HD).half() for _ in range(12)]
    for b, strength in ((1, 4.0), (5, 3.0), (9, 2.0)):
        blocks[b][:, :, 0] = strength
    _fill(store, seq, blocks, bt)
    q = torch.zeros(4, 1, HD)
    q[:, 0, 0] = 1.0
    assert store.select(seq, 0, q, 6 * bt) == [1, 2, 5, 6, 9]
    store.close()


def test_bad_select_successors_names_the_field():
    from kvtier.config import KVTierConfig

    with pytest.raises(ValueError, match="select_successors"):
        KVTierConfig(select_successors="yes")
