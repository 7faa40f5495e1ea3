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
    # shared: the one query-chosen slot goes to the best score over both kv heads (per_head would
    # give it to kv head 0, whose zero query ranks every block alike)
    store = make_store(tmp_path, block_tokens=bt, device_tokens=8 * bt, budget_tokens=2 * bt, sink_tokens=0,
                       window_tokens=0, attention="sparse", select_score=score, select_heads="shared")
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
        store = make_store(tmp_path / score, block_tokens=bt, device_tokens=8 * bt, budget_tokens=2 * bt,
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
