"""select_stickiness: resident candidates' scores rise by a factor before the top-k, in the
compiled scorer as in the torch specification (select.lift), and fewer blocks trade places."""
import numpy as np
import pytest
import torch

from kvtier.config import KVTierConfig
from kvtier.store import score_cpu
from kvtier.store.select import lift, round_robin
from tests.store.conftest import make_store

compiled_only = pytest.mark.skipif(not score_cpu.available(), reason="no C compiler: select() keeps the torch path")


def test_lift_raises_only_the_favoured_finite_scores():
    s = torch.tensor([0.1, 0.2, -0.4, float("-inf"), 0.0, 0.3])
    got = lift(s, np.array([0, 2, 3, 4], dtype=np.int64), 1.5)
    want = torch.tensor([0.25, 0.2, 0.2, float("-inf"), 0.0, 0.3])  # -0.4 + 1.5 * 0.4 for a signed bound
    torch.testing.assert_close(got, want)
    assert s[0] == 0.1  # the input is not changed
    assert lift(s, None, 1.0) is s and lift(s, np.array([1], dtype=np.int64), 0.0) is s
    per_head = lift(s.repeat(2, 1), np.array([5], dtype=np.int64), 1.0)  # [kv_heads, m]: every head's
    assert per_head[:, 5].tolist() == pytest.approx([0.6, 0.6])


@compiled_only
@pytest.mark.parametrize("quest, parts", [(False, 1), (False, 2), (True, 1)])
@pytest.mark.parametrize("per_head", [False, True])
def test_compiled_favour_is_the_torch_lift(quest, parts, per_head):
    """top_blocks with ``favor`` picks what the top-k (or round-robin) of the lifted scores picks."""
    g = torch.Generator().manual_seed(13)
    kvh, hd, lo, hi = 2, 32, 3, 83
    m = hi - lo
    for trial in range(10):
        q = torch.randn(kvh * 3, 1, hd, generator=g)
        digest = torch.randn(kvh, 96, (2 * hd if quest else hd) * parts, generator=g)
        qr, d = q.view(kvh, -1, hd), digest[:, lo:hi]
        if quest:
            qq = torch.cat((qr.clamp(min=0), qr.clamp(max=0)), dim=-1)
            head = torch.bmm(qq, d.transpose(1, 2)).amax(dim=1)
            shared = head.sum(0)
        else:
            s = torch.bmm(qr, d.reshape(kvh, m * parts, hd).transpose(1, 2)) * hd ** -0.5
            head = torch.softmax(s, dim=-1).amax(dim=1).view(kvh, m, parts).amax(dim=2)
            shared = head.amax(0)
        favor = torch.randperm(m, generator=g)[:m // 3].numpy().astype(np.int64)
        favor = np.concatenate([favor, [-3, m, m + 7]]).astype(np.int64)  # out of range: ignored
        gain = [0.5, 1.0, 3.0][trial % 3]
        for k in (1, 9, 40):
            got = score_cpu.top_blocks(q, digest, lo, hi, quest, hd ** -0.5, k, parts, per_head=per_head,
                                       favor=favor, gain=gain)
            if per_head:
                assert got == round_robin(lift(head, favor[(favor >= 0) & (favor < m)], gain), k)
            else:
                ref = lift(shared, favor[(favor >= 0) & (favor < m)], gain)
                top = torch.topk(ref, k + 1).values
                if top[k - 1] - top[k] > 1e-5 * top[0].abs():  # no tie to rounding at the k-th place
                    assert got == sorted(torch.topk(ref, k).indices.tolist())


@compiled_only
def test_a_resident_block_holds_its_place_up_to_the_gain():
    """Two blocks, the favoured one scoring half the other: kept with gain >= 1, lost below."""
    q = torch.zeros(1, 1, 8)
    q[0, 0, 0] = 1.0
    digest = torch.zeros(1, 4, 8)
    digest[0, 1, 0] = 2.0
    digest[0, 2, 0] = 2.0 + float(np.log(2.0))  # softmax: block 2 scores twice block 1
    s = score_cpu.block_scores(q, digest, 0, 4, False, 1.0)
    assert float(s[2] / s[1]) == pytest.approx(2.0, rel=1e-5)
    favor = np.array([1], dtype=np.int64)
    assert score_cpu.top_blocks(q, digest, 0, 4, False, 1.0, 1) == [2]
    assert score_cpu.top_blocks(q, digest, 0, 4, False, 1.0, 1, favor=favor, gain=0.9) == [2]
    assert score_cpu.top_blocks(q, digest, 0, 4, False, 1.0, 1, favor=favor, gain=1.1) == [1]


def _drifting_selects(stickiness: float, steps: int = 30):
    """Selections of a drifting query over a store whose L1 holds the budget (each step's new
    blocks are swapped in), the L1 misses they cost, and at how many steps the torch path would
    have chosen otherwise (asked on the same store at each step)."""
    bt, hd = 4, 16
    st = make_store(None, num_layers=1, kv_heads=2, head_dim=hd, dtype=torch.float32, block_tokens=bt,
                    device_tokens=16 * bt, host_bytes=1 << 22, codec="int8", sink_tokens=bt,
                    window_tokens=2 * bt, attention="sparse", select_stickiness=stickiness)
    compiled = st.selector.compiled
    g = torch.Generator().manual_seed(3)
    seq = st.add_sequence()
    k = torch.randn(2, 120 * bt, hd, generator=g)
    st.append(seq, 0, k, k)
    st.flush()
    q = torch.randn(4, 1, hd, generator=g)
    sels, differ = [], 0
    misses = st.stats()["misses"]["l1"]
    for _ in range(steps):
        q = 0.9 * q + 0.45 * torch.randn(4, 1, hd, generator=g)  # a query that drifts step to step
        sel = st.select(seq, 0, q)
        if compiled:
            st.selector.compiled = False
            differ += st.select(seq, 0, q) != sel
            st.selector.compiled = True
        st.gather_view(seq, 0, sel)
        sels.append(sel)
        st.end_step()
        # the step's swap-outs finish before the next selection: which blocks are resident (what
        # stickiness favours) must not depend on how fast the worker thread ran
        st.flush()
    misses = st.stats()["misses"]["l1"] - misses
    st.close()
    return sels, misses, differ


def test_stickiness_trades_fewer_blocks_and_paths_agree():
    plain, plain_misses, _ = _drifting_selects(0.0)
    sticky, sticky_misses, differ = _drifting_selects(1.0)
    assert all(len(s) == len(p) for s, p in zip(sticky, plain))
    assert sticky != plain and 0 < sticky_misses < plain_misses
    # C and torch sum in different orders: a tie to float32 rounding at the k-th place may go
    # either way; on random keys that is rare
    assert differ <= 1


@pytest.mark.parametrize("bad", [-0.5, 101, float("nan"), "1", True, None])
def test_select_stickiness_is_checked(bad):
    with pytest.raises(ValueError, match="select_stickiness must be a number in"):
        KVTierConfig(attention="sparse", select_stickiness=bad)
