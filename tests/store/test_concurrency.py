"""Races between the caller, the swap-out worker and the prefetcher: nothing lost or duplicated,
no deadlock (every test is bounded by a timeout)."""
import random
import threading
import time

import pytest
import torch

from .conftest import (Ref, assert_gathers, assert_reads_back, assert_rows, check_invariants, make_store, random_chunk,
                       sequences_on_threads)


def slow_swap_out(st, delay=0.002):
    """Widen the race windows: the worker's encode takes a while."""
    encode = st.io.encode_pair

    def slow(block, tier):
        if threading.current_thread().name.startswith("kvtier-swapout"):
            time.sleep(delay)
        return encode(block, tier)

    st.io.encode_pair = slow


def racing_steps(st, s: int, ref: Ref, rng: random.Random, steps: int = 300):
    """Append a random chunk to layer 0 of sequence ``s`` and end the step (victims go to the
    slow worker), ``steps`` times; after each step with a sealed block, yield the layer's table
    and the blocks pending swap-out then, for the caller to read while the worker runs."""
    for _ in range(steps):
        k, v = random_chunk(rng, sizes=(1, 2, 3))
        st.append(s, 0, k, v)
        ref.add(s, 0, k, v)
        st.end_step()
        t = st.residency.tables[s][0]
        if t.n_sealed:
            yield t, [e.idx for e in t.entries[:-1] if e.pending]


@pytest.mark.timeout(60)
def test_swap_out_racing_swap_in_of_the_same_block(tmp_path):
    st = make_store(tmp_path, num_layers=1, block_tokens=4, device_tokens=16, budget_tokens=16,
                    sink_tokens=0, window_tokens=0, policy="lru", high_watermark=0.75, low_watermark=0.5,
                    host_bytes=4096, attention="sparse")
    slow_swap_out(st)
    s = st.add_sequence()
    rng = random.Random(3)
    ref = Ref()
    cancels = 0
    for t, pending in racing_steps(st, s, ref, rng):
        # attend to blocks being swapped out right now, and to blocks already gone
        want = sorted(set(pending[:2]) | {rng.randrange(t.n_sealed)})[: st.hot_blocks - 1]
        cancels += sum(1 for b in want if t.entries[b].pending)
        K, V, pos = st.gather_blocks(s, 0, want)
        assert_rows(ref, s, 0, K, V, pos)
    assert cancels > 0, "the race was never exercised"
    check_invariants(st)
    assert_gathers(st, ref, s, 0)
    st.close()


@pytest.mark.timeout(60)
def test_eviction_during_prefetch(tmp_path):
    st = make_store(tmp_path, num_layers=3, block_tokens=4, device_tokens=16, budget_tokens=16,
                    sink_tokens=4, window_tokens=4, policy="h2o", host_bytes=4096, attention="sparse",
                    prefetch=True, prefetch_blocks=8)
    slow_swap_out(st, 0.001)
    seqs = [st.add_sequence() for _ in range(2)]
    rng = random.Random(5)
    ref = Ref()
    for step in range(120):
        for s in seqs:
            for layer in range(3):
                k, v = random_chunk(rng, sizes=(1,))
                st.append(s, layer, k, v)
                ref.add(s, layer, k, v)
                q = torch.randn(4, 1, 8)
                sel = st.select(s, layer, q)  # prefetches layer+1 while eviction runs
                K, V, pos = st.gather_blocks(s, layer, sel)
                assert_rows(ref, s, layer, K, V, pos)
                st.observe(s, layer, sel, torch.rand(len(sel) + 1))
        st.end_step()  # evicts and prefetches last step's selection
    stats = st.stats()
    assert stats["prefetch"]["issued"] > 0 and stats["swap_out_blocks"] > 0
    check_invariants(st)
    for (s, layer) in ref.chunks:
        assert_gathers(st, ref, s, layer)
    st.close()


@pytest.mark.timeout(90)
def test_many_sequences_interleaved_from_threads(tmp_path):
    # L1 sized for 2 sequences: it grows (twice) while other threads append and read
    st = make_store(tmp_path, num_layers=2, block_tokens=4, device_tokens=12, budget_tokens=12, host_bytes=8192,
                    max_sequences=2, policy="sink-window", sink_tokens=0, window_tokens=4, prefetch=True,
                    attention="sparse")

    def body(s, ref, rng, gen):
        for i in range(300):
            layer = rng.randrange(2)
            n = rng.choice((1, 1, 2, 6))
            k = torch.randn(2, n, 8, generator=gen).half()
            v = torch.randn(2, n, 8, generator=gen).half()
            st.append(s, layer, k, v)
            ref.add(s, layer, k, v)
            if i % 3 == 0:
                st.end_step()
            if i % 50 == 0:
                assert_gathers(st, ref, s, layer)
            elif i % 4 == 0 and st.seq_len(s, layer) > 8:
                # old blocks asked for: swapped in through scratch slots (L1 is full of the window)
                sel = st.select(s, layer, torch.randn(2, 1, 8, generator=gen))
                K, V, pos = st.gather_blocks(s, layer, sel)
                assert_rows(ref, s, layer, K, V, pos)

    refs = sequences_on_threads(st, 6, body)
    assert st.stats()["scratch_uses"] > 0 and st.stats()["l1_pool"]["growths"] >= 2
    check_invariants(st)
    assert_reads_back(st, refs)
    st.close()
