"""gather_view: K and V as views of each table's L1 region, checked against the copying
gather_blocks and a plain reference of everything appended, block by block via the returned order."""
import random

import pytest
import torch

from .conftest import (Ref, assert_gathers, assert_reads_back, assert_rows, check_invariants, make_store, random_chunk,
                       sequences_on_threads)
from .test_concurrency import racing_steps, slow_swap_out


def aliases_l1(st, x: torch.Tensor) -> bool:
    return x.untyped_storage().data_ptr() == st.l1.storage.untyped_storage().data_ptr()


def check_view(st, ref, s, layer, blocks, K, V, pos, order):
    """Rows of K/V are the tokens ``pos`` names; ``order`` names the block of every bt rows; the
    content equals the copying gather's, block by block."""
    bt = st.block_tokens
    ns = st.residency.tables[s][layer].n_sealed
    assert sorted(order[:-1]) == sorted(blocks) and order[-1] == ns
    assert torch.equal(pos, (torch.tensor(order)[:, None] * bt + torch.arange(bt)).view(-1)[: pos.numel()])
    assert_rows(ref, s, layer, K, V, pos)
    K, V = K.clone(), V.clone()  # gather_blocks below may change the region
    Kc, Vc, pos_c = st.gather_blocks(s, layer, sorted(blocks))
    where = {b: i for i, b in enumerate(sorted(blocks) + [ns])}
    for i, b in enumerate(order):
        j = where[b]
        n = min(bt, K.shape[1] - i * bt)
        assert torch.equal(K[:, i * bt:i * bt + n], Kc[:, j * bt:j * bt + n]), f"block {b}"
        assert torch.equal(V[:, i * bt:i * bt + n], Vc[:, j * bt:j * bt + n]), f"block {b}"


def filled(tokens: int, *args, **cfg):
    """A store (make_store(*args, **cfg)) with one sequence of ``tokens`` random fp16 tokens in
    layer 0 (2 kv heads, head_dim 8), and the reference holding the same."""
    st = make_store(*args, **cfg)
    s = st.add_sequence()
    ref = Ref()
    k, v = torch.randn(2, tokens, 8).half(), torch.randn(2, tokens, 8).half()
    st.append(s, 0, k, v)
    ref.add(s, 0, k, v)
    return st, s, ref


def chunk(rng, dtype, sizes):
    # values exact in fp16: the fp16 tier codec is then lossless for a float32 store as well
    k, v = random_chunk(rng, dtype=torch.float16, sizes=sizes)
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("policy,dtype", [("lru", torch.float16), ("h2o", torch.float32),
                                          ("sink-window", torch.bfloat16)])
def test_view_equals_copying_gather_across_changing_selections(tmp_path, policy, dtype):
    """Selections that mostly persist and sometimes churn, blocks evicted to L2/L3 and swapped
    back, blocks sealing under the open one, several sequences: every step equal to the reference."""
    st = make_store(tmp_path, num_layers=2, block_tokens=4, device_tokens=24, budget_tokens=24, host_bytes=4096,
                    policy=policy, attention="sparse", sink_tokens=4, window_tokens=4, dtype=dtype)
    rng = random.Random(7)
    ref = Ref()
    seqs = [st.add_sequence() for _ in range(2)]
    sels = {}
    views = calls = 0
    for step in range(250):
        for s in seqs:
            for layer in range(2):
                k, v = chunk(rng, dtype, (1, 1, 1, 2, 5))
                st.append(s, layer, k, v)
                ref.add(s, layer, k, v)
                ns = st.residency.tables[s][layer].n_sealed
                old = [b for b in sels.get((s, layer), []) if b < ns]
                r = rng.random()
                if r < 0.6:  # persistent selection, one block swapped now and then
                    sel = old
                    if ns and rng.random() < 0.3:
                        sel = old[1:] + [rng.randrange(ns)]
                elif r < 0.9:  # a fresh draw
                    sel = rng.sample(range(ns), min(ns, rng.randrange(st.hot_blocks)))
                else:
                    sel = []
                sel = list(dict.fromkeys(sel))[: st.hot_blocks - 1]
                rng.shuffle(sel)
                sels[(s, layer)] = sel
                before = st.counters["gather_views"]
                K, V, pos, order = st.gather_view(s, layer, sel)
                calls += 1
                if st.counters["gather_views"] > before:
                    views += 1
                    assert aliases_l1(st, K) and aliases_l1(st, V)
                check_view(st, ref, s, layer, sel, K, V, pos, order)
                st.observe(s, layer, order, torch.rand(len(order)))
        st.end_step()
        if step % 50 == 49:
            check_invariants(st)
    g = st.stats()["gather"]
    assert g["views"] == views and g["views"] + g["copies"] == calls
    # copies: steps that needed a scratch slot (fresh draws while the region is full of blocks not
    # yet written below L1) or would have moved a block the worker was reading
    assert views > 0.5 * calls and g["moved_blocks"] > 0
    assert st.stats()["swap_in_blocks"] > 0 and st.stats()["swap_out_blocks"] > 0
    check_invariants(st)
    for (s, layer) in ref.chunks:
        assert_gathers(st, ref, s, layer)
    st.close()


def test_steady_selection_moves_nothing_and_returns_the_same_views():
    st, s, ref = filled(30, num_layers=1, block_tokens=4, device_tokens=32, budget_tokens=32,
                        attention="sparse", policy="lru", high_watermark=1.0, low_watermark=0.9)
    K1, _, _, order1 = st.gather_view(s, 0, [5, 1, 3])
    moved = st.counters["region_moves"]
    K2, V2, pos2, order2 = st.gather_view(s, 0, [3, 5, 1])  # the same blocks, another order
    assert st.counters["region_moves"] == moved and order2 == order1
    assert K2.data_ptr() == K1.data_ptr() and aliases_l1(st, K2)
    check_view(st, ref, s, 0, [1, 3, 5], K2, V2, pos2, order2)
    # one more token lands in the open block: the view grows by one row, nothing moves
    k, v = torch.randn(2, 1, 8).half(), torch.randn(2, 1, 8).half()
    st.append(s, 0, k, v)
    ref.add(s, 0, k, v)
    K3, V3, pos3, order3 = st.gather_view(s, 0, [1, 3, 5])
    assert st.counters["region_moves"] == moved and K3.shape[1] == K2.shape[1] + 1
    check_view(st, ref, s, 0, [1, 3, 5], K3, V3, pos3, order3)
    st.close()


def test_open_block_moves_and_appends_follow_it():
    """When the run grows, the open block moves to its end; appends must then write the new slot."""
    # 4 sealed + open with 2
    st, s, ref = filled(18, num_layers=1, block_tokens=4, device_tokens=32, budget_tokens=32,
                        attention="sparse", policy="lru", high_watermark=1.0, low_watermark=0.9)
    t = st.residency.tables[s][0]
    for sel in ([], [0, 1, 2], [2], [3, 0, 1, 2], [1]):
        K, V, pos, order = st.gather_view(s, 0, sel)
        check_view(st, ref, s, 0, sel, K, V, pos, order)
        assert t.entries[-1].slot == t.base + len(sel)
        k, v = torch.randn(2, 1, 8).half(), torch.randn(2, 1, 8).half()
        st.append(s, 0, k, v)  # through the (moved) open block's views
        ref.add(s, 0, k, v)
        K, V, pos, order = st.gather_view(s, 0, sel)
        check_view(st, ref, s, 0, sel, K, V, pos, order)
    check_invariants(st)
    st.close()


def test_full_region_without_free_position_swaps():
    """Every region position taken: a block entering the run trades places with one leaving it."""
    # 3 sealed + open: region full
    st, s, ref = filled(14, num_layers=1, block_tokens=4, device_tokens=16, budget_tokens=16,
                        attention="sparse", policy="lru", high_watermark=1.0, low_watermark=0.9)
    t = st.residency.tables[s][0]
    assert t.resident == t.cap == 4
    for sel in ([0, 1], [2, 1], [0], [2, 0, 1], [1, 2]):
        K, V, pos, order = st.gather_view(s, 0, sel)
        check_view(st, ref, s, 0, sel, K, V, pos, order)
    assert st.counters["gather_copies"] == 0
    check_invariants(st)
    st.close()


def test_observe_gets_mass_in_the_view_order():
    st = make_store(num_layers=1, block_tokens=4, device_tokens=32, budget_tokens=32, attention="sparse",
                    policy="h2o", high_watermark=1.0, low_watermark=0.9)
    s = st.add_sequence()
    st.append(s, 0, torch.randn(2, 26, 8).half(), torch.randn(2, 26, 8).half())
    st.gather_view(s, 0, [0, 1, 2, 3])
    _, _, _, order = st.gather_view(s, 0, [5, 1, 3])  # 5 replaces 0 and 2 in the run
    st.observe(s, 0, order, torch.tensor([float(b) + 0.5 for b in order]))
    t = st.residency.tables[s][0]
    for b in order:
        assert t.entries[b].mass == pytest.approx(b + 0.5)
    assert t.entries[0].mass == 0 and t.entries[2].mass == 0
    st.close()


def test_scratch_slot_falls_back_to_a_copy(tmp_path):
    """The region full of dirty blocks: a swapped-in block takes a scratch slot, so this step's
    K and V are copied; the content is the same."""
    # 5 sealed: one was evicted
    st, s, ref = filled(22, tmp_path, num_layers=1, block_tokens=4, device_tokens=16, budget_tokens=16,
                        attention="sparse", policy="lru", high_watermark=1.0, low_watermark=0.9)
    st.flush()
    t = st.residency.tables[s][0]
    gone = [e.idx for e in t.entries[:-1] if e.slot is None]
    assert gone and t.resident == t.cap
    sel = [gone[0], next(e.idx for e in t.entries[:-1] if e.slot is not None)]
    K, V, pos, order = st.gather_view(s, 0, sel)
    assert st.counters["scratch_uses"] == 1 and st.counters["gather_copies"] == 1 and not aliases_l1(st, K)
    check_view(st, ref, s, 0, sel, K, V, pos, order)
    check_invariants(st)
    st.close()


@pytest.mark.timeout(60)
def test_pending_block_is_never_moved_while_the_worker_reads_it(tmp_path):
    """The worker encodes a pending block from its slot without the lock: a step whose run would
    move a pending block copies instead, and every swap-out still writes the right bytes."""
    st = make_store(tmp_path, num_layers=1, block_tokens=4, device_tokens=24, budget_tokens=24,
                    sink_tokens=0, window_tokens=0, policy="lru", high_watermark=0.7, low_watermark=0.4,
                    host_bytes=4096, attention="sparse")
    slow_swap_out(st, 0.003)
    s = st.add_sequence()
    rng = random.Random(11)
    ref = Ref()
    touched_pending = 0
    for t, pending in racing_steps(st, s, ref, rng):
        ns = t.n_sealed
        want = list(dict.fromkeys(pending[:2] + rng.sample(range(ns), min(ns, 2))))[: st.hot_blocks - 1]
        touched_pending += sum(1 for b in want if t.entries[b].pending)
        K, V, pos, order = st.gather_view(s, 0, want)
        assert_rows(ref, s, 0, K, V, pos)
    assert touched_pending > 0, "the race was never exercised"
    g = st.stats()["gather"]
    assert g["views"] > 0 and g["copies"] > 0
    check_invariants(st)
    st.flush()
    # every block's copy below L1 holds its own tokens
    t = st.residency.tables[s][0]
    rk, _ = ref.kv(s, 0)
    for e in t.entries[:-1]:
        if e.l2:
            d = st.offload.load(e)
            assert torch.equal(d[0], rk[:, e.idx * 4:(e.idx + 1) * 4]), f"block {e.idx} written wrong"
    assert_gathers(st, ref, s, 0)
    st.close()


@pytest.mark.timeout(90)
def test_sequences_on_threads_with_views(tmp_path):
    """One thread per sequence appending and reading views while the worker and the prefetcher
    run: regions are per table, so no thread moves another's blocks."""
    st = make_store(tmp_path, num_layers=2, block_tokens=4, device_tokens=16, budget_tokens=16, host_bytes=8192,
                    max_sequences=4, policy="h2o", sink_tokens=4, window_tokens=4, prefetch=True,
                    attention="sparse")
    slow_swap_out(st, 0.001)

    def body(s, ref, rng, gen):
        for i in range(200):
            for layer in range(2):
                n = rng.choice((1, 1, 1, 3))
                k = torch.randn(2, n, 8, generator=gen).half()
                v = torch.randn(2, n, 8, generator=gen).half()
                st.append(s, layer, k, v)
                ref.add(s, layer, k, v)
                sel = st.select(s, layer, torch.randn(4, 1, 8, generator=gen))
                K, V, pos, order = st.gather_view(s, layer, sel)
                assert_rows(ref, s, layer, K, V, pos)
                st.observe(s, layer, order, torch.rand(len(order)))
            if i % 2 == 0:
                st.end_step()

    refs = sequences_on_threads(st, 4, body)
    assert st.stats()["gather"]["moved_blocks"] > 0
    check_invariants(st)
    assert_reads_back(st, refs)
    st.close()


def test_regions_are_disjoint_and_reused_after_drop():
    st = make_store(num_layers=3, block_tokens=4, device_tokens=16, max_sequences=2, attention="sparse")
    a, b = st.add_sequence(), st.add_sequence()
    bases = sorted(t.base for s in (a, b) for t in st.residency.tables[s])
    assert bases == [i * st.hot_blocks for i in range(6)]
    freed = sorted(t.base for t in st.residency.tables[a])
    st.drop_sequence(a)
    c = st.add_sequence()
    assert sorted(t.base for t in st.residency.tables[c]) == freed
    for s in (b, c):
        for layer in range(3):
            st.append(s, layer, torch.randn(2, 9, 8).half(), torch.randn(2, 9, 8).half())
            t = st.residency.tables[s][layer]
            assert all(t.base <= e.slot < t.base + t.cap for e in t.entries if e.slot is not None)
    check_invariants(st)
    st.close()


def test_gather_view_checks_its_input():
    st = make_store(num_layers=1, block_tokens=4, device_tokens=16, attention="sparse")
    s = st.add_sequence()
    with pytest.raises(ValueError, match="empty"):
        st.gather_view(s, 0, [])
    st.append(s, 0, torch.randn(2, 10, 8).half(), torch.randn(2, 10, 8).half())
    with pytest.raises(ValueError, match="distinct"):
        st.gather_view(s, 0, [1, 1])
    with pytest.raises(ValueError, match="sealed block"):
        st.gather_view(s, 0, [2])
    with pytest.raises(ValueError, match="at most"):
        st.gather_view(s, 0, [0, 1, 2, 3])
    st.close()


def test_swapped_in_block_lands_inside_the_run(tmp_path):
    """A missing selected block is decoded straight into the run: the unselected block holding
    that position moves to a free place past the run (one copy), no second move of the new block."""
    st, s, ref = filled(30, tmp_path, num_layers=1, block_tokens=4, device_tokens=24, budget_tokens=24,
                        attention="sparse", policy="lru")
    st.end_step()
    st.flush()
    t = st.residency.tables[s][0]
    # what end_step left: [b6][open b7][ ][ ][b4][b5], blocks 0-3 below L1
    assert [e.idx if e else None for e in t.at] == [6, 7, None, None, 4, 5]
    K, V, pos, order = st.gather_view(s, 0, [4, 0])
    check_view(st, ref, s, 0, [4, 0], K, V, pos, order)
    assert t.entries[0].slot == t.base  # b0 decoded into position 0 (b6 moved out to 3)
    assert order == [0, 4, 7]
    # b6 out, b4 in, and the open block after them
    assert st.stats()["gather"]["moved_blocks"] == 3
    check_invariants(st)
    st.close()


@pytest.mark.parametrize("method", ["gather_view", "gather_blocks"])
def test_block_freed_by_another_thread_during_a_swap_in(tmp_path, method):
    """Another thread's end_step evicts while this gather swaps a block in: the (clean) selected
    block already counted as a hit stays pinned in L1, so the install cannot take its region
    slot and the gather never returns the newcomer's data twice."""
    st, s, ref = filled(30, tmp_path, num_layers=1, block_tokens=4, device_tokens=24, budget_tokens=24,
                        attention="sparse", policy="lru")
    st.end_step()
    st.flush()
    st.gather_view(s, 0, [0, 1])  # 0 and 1 back in L1, clean (their copies stay in L2)
    t = st.residency.table(s, 0)
    assert t.entries[0].slot is not None and t.entries[0].clean and t.entries[2].slot is None
    fetch = st.prefetcher.fetch_many
    fired = []

    def fetch_racing(ents):
        if not fired:
            fired.extend(e.idx for e in ents)
            # what a concurrent end_step does: evict every clean block it may, block 0 first (lru)
            st.residency.free_clean_victims(t, t.resident, frozenset(), force=True)
            assert t.entries[0].slot is not None, "a pinned block was evicted during a read"
        return fetch(ents)

    st.prefetcher.fetch_many = fetch_racing
    out = getattr(st, method)(s, 0, [0, 2])
    K, V, pos = out[:3]
    assert fired == [2]
    assert_rows(ref, s, 0, K, V, pos)
    assert sorted(set((pos // 4).tolist())) == [0, 2, 7]
    check_invariants(st)
    st.close()
