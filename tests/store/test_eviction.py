"""Eviction through the store: watermarks, batches, policies on real appends."""
import torch

from .conftest import check_invariants, make_store


def resident(st, s, layer=0):
    return [e.idx for e in st.residency.tables[s][layer].entries if e.slot is not None]


def test_watermarks_and_exact_victims_sink_window():
    # 8 blocks of L1; high = ceil(0.9*8) = 8, low = floor(0.5*8) = 4
    st = make_store(None, num_layers=1, block_tokens=4, device_tokens=32, sink_tokens=4, window_tokens=4,
                    high_watermark=0.9, low_watermark=0.5, policy="sink-window", host_bytes=1 << 20)
    s = st.add_sequence()
    tok = torch.ones(2, 1, 8).half()
    seen_max = 0
    for i in range(7 * 4 + 1):  # blocks 0..6 sealed, 7 open: 8 resident at the last step
        st.append(s, 0, tok * i, tok * i)
        t = st.residency.tables[s][0]
        seen_max = max(seen_max, t.resident)
        if i < 7 * 4:
            st.end_step()
            assert t.resident - t.pending <= 7
    st.end_step()
    st.flush()
    # sinks {0}, window {6} and the open block stay; the middle leaves oldest first
    assert resident(st, s) == [0, 5, 6, 7]
    assert seen_max <= st.hot_blocks
    assert st.stats()["swap_out_blocks"] == 4
    check_invariants(st)
    st.close()


def test_lru_store_order_follows_use():
    # 6 blocks of L1; high = 6, low = 3
    st = make_store(None, num_layers=1, block_tokens=4, device_tokens=24, high_watermark=1.0,
                    low_watermark=0.5, policy="lru", host_bytes=1 << 20, budget_tokens=24)
    s = st.add_sequence()
    st.append(s, 0, torch.randn(2, 17, 8).half(), torch.randn(2, 17, 8).half())  # sealed 0..3, open 4
    st.end_step()  # step 0 -> 1: 5 resident, below high
    st.gather_blocks(s, 0, [0, 2])  # used at step 1
    st.end_step()
    st.gather_blocks(s, 0, [3])  # used at step 2
    st.append(s, 0, torch.randn(2, 4, 8).half(), torch.randn(2, 4, 8).half())  # seals 4 (step 2), opens 5
    st.end_step()
    st.flush()
    # last use: 0->1, 1->0, 2->1, 3->2, 4->2; three leave: 1, then 0 and 2 (older first)
    assert resident(st, s) == [3, 4, 5]
    assert st.stats()["swap_out_blocks"] == 3
    st.close()


def test_h2o_keeps_blocks_with_most_mass():
    st = make_store(None, num_layers=1, block_tokens=4, device_tokens=32, sink_tokens=0, window_tokens=4,
                    high_watermark=0.9, low_watermark=0.5, policy="h2o", host_bytes=1 << 20,
                    attention="sparse")
    s = st.add_sequence()
    st.append(s, 0, torch.randn(2, 29, 8).half(), torch.randn(2, 29, 8).half())  # sealed 0..6, open 7
    mass = torch.tensor([0.1, 5.0, 0.2, 3.0, 0.05, 0.3, 0.0])
    st.observe(s, 0, range(7), mass)
    st.observe(s, 0, [2, 4], torch.tensor([0.0, 1.0, 9.9]))  # +open block mass
    st.end_step()
    st.flush()
    # accumulated: 0:.1 1:5 2:.2 3:3 4:1.05 5:.3 (6 is the window, 7 open); 4 leave: 0, 2, 5, 4
    assert resident(st, s) == [1, 3, 6, 7]
    assert abs(st.residency.tables[s][0].entries[7].mass - 9.9) < 1e-5
    check_invariants(st)
    st.close()


def test_snapkv_importance_frozen_after_observation_window():
    st = make_store(None, num_layers=1, block_tokens=4, device_tokens=32, sink_tokens=0, window_tokens=4,
                    high_watermark=0.9, low_watermark=0.5, policy="snapkv", host_bytes=1 << 20,
                    snapkv_observe_steps=1)
    s = st.add_sequence()
    k = torch.randn(2, 29, 8).half() * 0.01
    k[:, 13, 2] = 40.0  # block 3 is what the observation window looks at
    k[:, 21, 2] = 40.0  # block 5 too
    st.append(s, 0, k, k)
    q = torch.zeros(2, 4, 8)
    q[:, :, 2] = 1.0
    st.observe_queries(s, 0, q)  # the vote at the end of prefill
    st.observe(s, 0, [0, 1, 2], torch.tensor([50.0, 50.0, 50.0]))  # later mass: not importance
    st.end_step()
    st.flush()
    assert set(resident(st, s)) >= {3, 5, 6, 7}
    assert resident(st, s) == [3, 5, 6, 7]
    st.close()
