"""A swap-out that fails on the worker, and an append that fails part-way: nothing half done.

A block whose encoding or put raises on the swap-out worker stays in L1 at full precision; the
failure is raised once, by the next call on its own sequence, naming the block; every other
sequence, and that one afterwards, goes on as if nothing happened. An append that opens blocks
and then finds no room anywhere is undone: the table holds exactly what it held before.
"""
import pytest
import torch

from kvtier.store import SwapOutError

from .conftest import Ref, assert_gathers, check_invariants, make_store

BAD = 7.0  # a K value that makes the injected codec failure fire


def _failing_encode(st, monkeypatch):
    """Make the worker's encoder raise for any block holding the value BAD."""
    orig = st.io.encode_pair

    def encode_pair(block, tier, codec=None):
        if bool((block == BAD).any()):
            raise OSError("injected codec failure")
        return orig(block, tier, codec)

    monkeypatch.setattr(st.io, "encode_pair", encode_pair)


def _chunk(n, g, bad_at=None):
    k = torch.randn(2, n, 8, generator=g).half()
    v = torch.randn(2, n, 8, generator=g).half()
    if bad_at is not None:
        k[1, bad_at, 3] = BAD
    return k, v


def _exact(st, ref, s):
    assert_gathers(st, ref, s, 0)


def _failing_l2_put(st, monkeypatch, bad_key):
    orig = st.l2.put

    def put(key, value):
        if key == bad_key:
            raise OSError("injected L2 failure")
        return orig(key, value)

    monkeypatch.setattr(st.l2, "put", put)


@pytest.mark.parametrize("where", ["codec", "l2_put"])
def test_failed_swap_out_keeps_the_block_in_l1_and_tells_only_its_sequence_once(monkeypatch, where):
    st = make_store(None, num_layers=1, device_tokens=32, host_bytes=1 << 20, codec="fp16",
                    high_watermark=0.5, low_watermark=0.25)
    g = torch.Generator().manual_seed(0)
    ref, a, b = Ref(), st.add_sequence(), st.add_sequence()
    k, v = _chunk(4, g, bad_at=2)  # block 0 of a: its swap-out fails
    st.append(a, 0, k, v)
    ref.add(a, 0, k, v)
    if where == "codec":
        _failing_encode(st, monkeypatch)
    else:
        _failing_l2_put(st, monkeypatch, st.residency.table(a, 0).entries[0].rec.key)
    for s in (a, b):
        for _ in range(5):
            k, v = _chunk(4, g)
            st.append(s, 0, k, v)
            ref.add(s, 0, k, v)
    st.end_step()  # both over the watermark: a's block 0 and b's oldest go to the worker
    st.flush()  # the failure is not the flusher's: it belongs to sequence a
    for _ in range(3):
        _exact(st, ref, b)  # another sequence never sees it
    with pytest.raises(SwapOutError, match=f"block 0 of sequence {a} layer 0") as info:
        st.gather(a, 0)
    assert isinstance(info.value.__cause__, OSError) and (info.value.seq, info.value.block) == (a, 0)
    _exact(st, ref, a)  # raised once; the block is in L1 at full precision
    t = st.residency.table(a, 0)
    assert t.entries[0].slot is not None and not t.entries[0].pending
    ev = st.stats()["evictions"]
    assert ev["swap_out_errors"] == 1 and ev["held"] == 1 and ev["dirty"] >= 2
    for _ in range(6):  # later appends, steps and evictions pass it over and go on
        for s in (a, b):
            k, v = _chunk(3, g)
            st.append(s, 0, k, v)
            ref.add(s, 0, k, v)
        st.end_step()
    for s in (a, b):
        _exact(st, ref, s)
    assert st.stats()["evictions"]["swap_out_errors"] == 1  # never chosen again
    check_invariants(st)
    st.truncate_sequence(a, 2)  # cut inside it: new content, evictable again
    ref.chunks[(a, 0)] = [(c[:, :2], d[:, :2]) for c, d in ref.chunks[(a, 0)][:1]]
    assert not st.residency.table(a, 0).entries[0].held
    _exact(st, ref, a)
    st.drop_sequence(a)
    check_invariants(st)
    st.close()  # nothing kept for close to raise


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_nan_kv_past_the_append_check_fails_its_swap_out_cleanly(device):
    # on CUDA append does not check finiteness (a host sync per layer and step): the int8
    # codec's check on the worker (side stream) is then what finds NaN; on CPU appended past
    # append's check
    st = make_store(None, num_layers=1, device_tokens=32, host_bytes=1 << 20, codec="int8",
                    high_watermark=0.5, low_watermark=0.25, device=device)
    g = torch.Generator().manual_seed(1)
    a, b = st.add_sequence(), st.add_sequence()
    k, v = _chunk(4, g)
    k[0, 1, 1] = float("nan")
    if device == "cuda":
        st.append(a, 0, k, v)
    else:
        st.appender.append(st.residency.table(a, 0), k, v)
    for s in (a, b):
        for _ in range(4):
            st.append(s, 0, *_chunk(4, g))
    st.end_step()
    st.flush()
    st.gather(b, 0)
    with pytest.raises(SwapOutError, match="block 0 of sequence") as info:
        st.append(a, 0, *_chunk(1, g))
    assert isinstance(info.value.__cause__, ValueError) and "finite" in str(info.value.__cause__)
    assert st.seq_len(a, 0) == 20  # the call that raised appended nothing
    for _ in range(4):
        for s in (a, b):
            st.append(s, 0, *_chunk(4, g))
        st.end_step()
    K = st.gather(a, 0)[0].cpu()
    assert K.shape[1] == 36 and torch.isnan(K[:, :4]).any() and torch.isfinite(K[:, 4:]).all()
    check_invariants(st)
    st.close()


def test_every_block_of_a_region_held_is_a_clear_error_and_the_append_is_undone(monkeypatch):
    st = make_store(None, num_layers=1, device_tokens=8, host_bytes=1 << 20, codec="fp16")
    _failing_encode(st, monkeypatch)
    g = torch.Generator().manual_seed(2)
    ref, a = Ref(), st.add_sequence()
    k, v = _chunk(6, g, bad_at=1)
    k[0, 5, 0] = BAD  # blocks 0 and 1 both fail: the region (2 blocks) fills with held blocks
    st.append(a, 0, k, v)
    ref.add(a, 0, k, v)
    k, v = _chunk(3, g)
    for failed in (0, 1):
        with pytest.raises(RuntimeError, match="failed to swap out and stay in L1") as info:
            st.append(a, 0, k, v)  # block 2 needs room: blocks 0 and 1 both fail to leave
        # the failure, raised with it once: block 0's first, then block 1's, which the undo
        # reopened (as it was before the append) and the next append sealed and failed again
        assert isinstance(info.value.__cause__, SwapOutError) and info.value.__cause__.block == failed
    assert st.stats()["evictions"]["swap_out_errors"] == 3
    assert st.seq_len(a, 0) == 6
    _exact(st, ref, a)
    check_invariants(st)
    st.drop_sequence(a)
    b = st.add_sequence()
    st.append(b, 0, k, v)
    st.close()


@pytest.mark.parametrize("codec", ["int8", "fp16"])
def test_append_that_finds_no_room_part_way_leaves_the_table_as_it_was(codec):
    # L2 holds a few blocks and there is no L3: a long append fills it and fails part-way,
    # after sealing and evicting the block that was open (stored lossy with int8)
    st = make_store(None, num_layers=1, device_tokens=8, host_bytes=4096, codec=codec)
    g = torch.Generator().manual_seed(3)
    a = st.add_sequence()
    st.append(a, 0, *_chunk(6, g))  # block 1 open with 2 tokens
    st.evictor.make_room(st.residency.table(a, 0), 1)  # block 0 to L2 (what is lossy stays so)
    before = st.gather(a, 0)
    stats0 = st.stats()
    with pytest.raises(RuntimeError, match="L2 refused"):
        st.append(a, 0, *_chunk(400, g))
    assert st.stats()["swap_out_blocks"] > stats0["swap_out_blocks"]  # it did evict on the way
    assert st.seq_len(a, 0) == 6
    after = st.gather(a, 0)
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    check_invariants(st)
    assert st.stats()["bytes"]["l2"] == stats0["bytes"]["l2"]  # the undone blocks' copies are gone
    k, v = _chunk(3, g)
    st.append(a, 0, k, v)  # goes on from the 6 tokens it held
    K, V = st.gather(a, 0)
    assert torch.equal(K, torch.cat((before[0], k), 1)) and torch.equal(V, torch.cat((before[1], v), 1))
    check_invariants(st)
    st.close()


def test_a_write_through_that_raises_is_counted_and_never_raised_into_another_call(tmp_path, monkeypatch):
    st = make_store(tmp_path, num_layers=1, device_tokens=32, host_bytes=1 << 20, codec="fp16",
                    fingerprint="test-model:write-through")
    orig = st.io.encode_pair

    def encode_pair(block, tier, codec=None):  # the disk-codec encoding of write-through fails
        if tier == "l3":
            raise OSError("injected write-through failure")
        return orig(block, tier, codec)

    monkeypatch.setattr(st.io, "encode_pair", encode_pair)
    g = torch.Generator().manual_seed(4)
    ref, a = Ref(), st.add_sequence()
    st.note_tokens(a, list(range(40)))
    with pytest.warns(RuntimeWarning, match="write-through to L3/L4 failed .*injected"):
        for _ in range(10):
            k, v = _chunk(4, g)
            st.append(a, 0, k, v)  # seals blocks: each one's write-through fails on the publisher
            ref.add(a, 0, k, v)
            st.end_step()
        st.flush()
    s = st.stats()
    assert s["prefix"]["publish_encode_failed"] >= 8 and s["prefix"]["published_l3"]["blocks"] == 0
    assert isinstance(st.publisher.last_error, OSError)
    _exact(st, ref, a)  # what was stored is all there (L1 and L2)
    check_invariants(st)
    st.close()


def test_an_item_settled_twice_leaves_the_pending_count_at_zero():
    """Settling is idempotent on every path: a second ``swapped_out`` for an item already
    settled (by an earlier ``swapped_out`` or ``swap_failed``) changes nothing, so the table's
    pending count, which ``flush`` waits on, never goes below zero."""
    st = make_store(None, num_layers=1, kv_heads=2, head_dim=8, block_tokens=4, device_tokens=16,
                    host_bytes=1 << 20, codec="fp16")
    s = st.add_sequence()
    st.append(s, 0, torch.randn(2, 9, 8).half(), torch.randn(2, 9, 8).half())
    res = st.residency
    t = res.table(s, 0)
    for settle in ("swapped_out", "swap_failed"):
        e = next(x for x in t.entries[:t.n_sealed] if not x.pending and not x.clean and x.slot is not None)
        with res.lock:
            assert res._mark(t, [e.idx], free_clean=False) == [(t, e)]
        assert t.pending == 1
        if settle == "swapped_out":
            res.swapped_out(t, e, None, clean=False)
        else:
            res.swap_failed(t, e, RuntimeError("test"))
        res.swapped_out(t, e, None, clean=False)  # the same item again
        assert t.pending == 0 and not e.pending
    res.release_pending([(t, e)])
    assert t.pending == 0
    st.close()
