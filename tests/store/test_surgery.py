"""Sequence surgery on the store: truncate (crop) anywhere, fork sharing sealed blocks, all-or-none
registration. Small shapes, blocks really evicted to L2 and L3, fp16 (lossless) codec."""
from __future__ import annotations

import pytest
import torch

from .conftest import check_invariants, make_store, random_chunk


def _fill(st, seq, n, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, n, 8, generator=g).half()
    v = torch.randn(2, n, 8, generator=g).half()
    for layer in range(st.num_layers):
        for lo in range(0, n, 3):  # several appends: blocks sealed on the way
            st.append(seq, layer, k[:, lo:lo + 3], v[:, lo:lo + 3])
        st.end_step()
    return k, v


def _reads(st, seq, k, v):
    for layer in range(st.num_layers):
        K, V = st.gather(seq, layer)
        assert torch.equal(K, k) and torch.equal(V, v), f"layer {layer}"


@pytest.mark.parametrize("cut", [0, 1, 4, 6, 13, 29, 46])
def test_truncate_anywhere_then_append_reads_back(tmp_path, cut):
    st = make_store(tmp_path, host_bytes=4096)
    try:
        seq = st.add_sequence()
        k, v = _fill(st, seq, 47, seed=1)
        st.flush()
        assert st.stats()["blocks"]["l3"] > 0  # the cut crosses blocks that live on disk
        st.truncate_sequence(seq, cut)
        assert all(st.seq_len(seq, layer) == cut for layer in range(st.num_layers))
        check_invariants(st)
        _reads(st, seq, k[:, :cut], v[:, :cut])
        k2, v2 = _fill(st, seq, 9, seed=2)  # appends after the cut write a new tail
        _reads(st, seq, torch.cat((k[:, :cut], k2), 1), torch.cat((v[:, :cut], v2), 1))
        check_invariants(st)
    finally:
        st.close()


def test_truncate_cuts_token_ids_and_keeps_prefix_keys(tmp_path):
    st = make_store(tmp_path, fingerprint="m")
    try:
        seq = st.add_sequence()
        ids = torch.arange(100, 131)
        st.note_tokens(seq, ids)
        _fill(st, seq, 31, seed=3)
        st.truncate_sequence(seq, 10)
        assert st.tokens_noted(seq) == 10
        st.note_tokens(seq, ids[10:20])  # the same ids again: the same content keys as before
        _fill(st, seq, 10, seed=3)
        assert st.match_prefix(ids[:16]) == 16
    finally:
        st.close()


def test_fork_shares_sealed_blocks_and_copies_on_write(tmp_path):
    st = make_store(tmp_path, host_bytes=4096)
    try:
        a = st.add_sequence()
        k, v = _fill(st, a, 42, seed=4)
        st.flush()
        before = st.stats()["copies"]
        b = st.fork_sequence(a)
        after = st.stats()["copies"]
        assert after["l2"] == before["l2"] and after["l3"] == before["l3"]  # no copy below L1
        _reads(st, b, k, v)
        ka, va = _fill(st, a, 5, seed=5)
        kb, vb = _fill(st, b, 7, seed=6)
        _reads(st, a, torch.cat((k, ka), 1), torch.cat((v, va), 1))
        _reads(st, b, torch.cat((k, kb), 1), torch.cat((v, vb), 1))
        st.drop_sequence(a)  # the fork keeps the shared copies alive
        _reads(st, b, torch.cat((k, kb), 1), torch.cat((v, vb), 1))
        check_invariants(st)
        st.truncate_sequence(b, 3)
        _reads(st, b, k[:, :3], v[:, :3])
        check_invariants(st)
    finally:
        st.close()


def test_add_sequences_is_all_or_none(tmp_path):
    # L1 may hold 3 sequences (2816 bytes each: see test_store.test_bad_store_config), 2 at first
    st = make_store(tmp_path, max_sequences=2, device_max_bytes=3 * 2816)
    try:
        st.add_sequences(2)
        with pytest.raises(MemoryError, match="device_max_bytes"):
            st.add_sequences(2)
        assert len(st.sequences()) == 2
        with pytest.raises(MemoryError, match="device_max_bytes"):
            st.fork_sequence(st.sequences()[0]) and st.fork_sequence(st.sequences()[0])
        assert len(st.sequences()) == 3
        with pytest.raises(ValueError, match="length"):
            st.truncate_sequence(st.sequences()[0], -1)
    finally:
        st.close()


def test_pool_grows_past_max_sequences_keeping_every_block(tmp_path, rng):
    """More live sequences than the pool was sized for: it grows (doubling), every sequence's
    blocks (resident, open, evicted) read back bit-exact, and the views appends write through
    follow the new pool."""
    st = make_store(tmp_path, max_sequences=1)
    try:
        seqs, ref = [], {}
        for i in range(5):
            s = st.add_sequence()
            seqs.append(s)
            for _ in range(3):  # interleaved with the growths: 1 -> 2 -> 4 -> 8 sequences
                for layer in range(2):
                    k, v = random_chunk(rng, sizes=(1, 3, 7))
                    st.append(s, layer, k, v)
                    ref.setdefault((s, layer), []).append((k, v))
                st.end_step()
        f = st.fork_sequence(seqs[0])
        for (s, layer), parts in list(ref.items()):
            if s == seqs[0]:
                ref[(f, layer)] = list(parts)
        for layer in range(2):  # the fork and its source grow apart after the fork
            for s in (f, seqs[0]):
                k, v = random_chunk(rng, sizes=(2,))
                st.append(s, layer, k, v)
                ref[(s, layer)].append((k, v))
        check_invariants(st)
        pool = st.stats()["l1_pool"]
        assert pool["sequences"] == 8 and pool["growths"] == 3
        for (s, layer), parts in ref.items():
            K, V = st.gather(s, layer)
            assert torch.equal(K, torch.cat([k for k, _ in parts], 1))
            assert torch.equal(V, torch.cat([v for _, v in parts], 1))
    finally:
        st.close()
