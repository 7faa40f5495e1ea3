"""Content-addressed prefix keys (kvtier.store.prefix)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvtier.store.prefix import (HASH_BYTES, block_key, chained_block_hashes, chained_block_keys,
                                 model_fingerprint_key)

FP = model_fingerprint_key("llama-0123456789abcdef", "int4", 16,
                           codec_params={"group_size": 32}, dtype=torch.float16)


def ids(n, seed=0):
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed))


def test_identical_prefixes_identical_keys_in_any_container():
    t = ids(100)
    a = chained_block_keys(t, 16, 3, FP)
    assert len(a) == 6 and all(len(row) == 3 for row in a)
    assert chained_block_keys(t.tolist(), 16, 3, FP) == a
    assert chained_block_keys(t.numpy().astype(np.int32), 16, 3, FP) == a
    # a longer sequence sharing the prefix shares exactly the prefix's full blocks
    longer = torch.cat([t[:96], ids(50, seed=1)])
    b = chained_block_keys(longer, 16, 3, FP)
    assert b[:6] == a and len(b) == 9
    assert not set(sum(b[6:], [])) & set(sum(a, []))


def test_key_layout_and_all_distinct():
    keys = chained_block_keys(ids(64), 16, 4, FP)
    flat = sum(keys, [])
    assert len(set(flat)) == 16
    h = chained_block_hashes(ids(64), 16, FP)
    for b in range(4):
        for layer in range(4):
            assert keys[b][layer] == f"{FP}/{layer}/{h[b]}" == block_key(FP, layer, h[b])
    assert all(len(x) == 2 * HASH_BYTES and int(x, 16) >= 0 for x in h)
    assert len(flat[0].encode()) < 100  # leaves room for a remote key prefix within 255 bytes


@pytest.mark.parametrize("pos", [0, 17, 40, 63])
def test_one_token_different_changes_its_block_and_all_later(pos):
    t = ids(64)
    u = t.clone()
    u[pos] += 1
    a, b = chained_block_hashes(t, 16, FP), chained_block_hashes(u, 16, FP)
    first = pos // 16
    assert a[:first] == b[:first]
    assert all(x != y for x, y in zip(a[first:], b[first:]))


def test_same_tokens_in_a_different_block_position_differ():
    # a block's hash depends on the whole prefix, not only its own tokens
    blk = ids(16)
    a = chained_block_hashes(torch.cat([blk, blk]), 16, FP)
    assert a[0] != a[1]


@pytest.mark.parametrize("change", [
    dict(fingerprint="llama-fedcba9876543210"), dict(codec="int8"), dict(block_tokens=32),
    dict(codec_params={"group_size": 64}), dict(dtype="bfloat16"), dict(extra={"order": "x"}),
])
def test_any_fingerprint_component_gives_disjoint_keys(change):
    base = dict(fingerprint="llama-0123456789abcdef", codec="int4", block_tokens=16,
                codec_params={"group_size": 32}, dtype="float16")
    other = model_fingerprint_key(**{**base, **change})
    assert model_fingerprint_key(**base) == FP != other
    t = ids(128)
    mine = set(sum(chained_block_keys(t, 16, 2, FP), []))
    theirs = set(sum(chained_block_keys(t, 16, 2, other), []))
    assert len(mine) == len(theirs) == 16 and not mine & theirs
    # the hash itself (not only the key's first component) depends on the fingerprint
    assert not set(chained_block_hashes(t, 16, FP)) & set(chained_block_hashes(t, 16, other))


def test_partial_tail_block_gets_no_key():
    assert chained_block_keys(ids(15), 16, 2, FP) == []
    assert chained_block_keys([], 16, 2, FP) == []
    assert len(chained_block_keys(ids(47), 16, 2, FP)) == 2
    assert len(chained_block_hashes(ids(48), 16, FP)) == 3


def test_continuing_a_chain_with_parent_matches_whole():
    t = ids(96)
    whole = chained_block_hashes(t, 16, FP)
    head = chained_block_hashes(t[:32], 16, FP)
    tail = chained_block_hashes(t[32:], 16, FP, parent=head[-1])
    assert head + tail == whole
    assert chained_block_keys(t[32:], 16, 2, FP, parent=head[-1]) == chained_block_keys(t, 16, 2, FP)[2:]


@pytest.mark.slow  # starts Python processes that import torch
def test_stable_across_processes():
    # never Python's hash(): another interpreter (other PYTHONHASHSEED) computes the same keys
    code = ("from kvtier.store.prefix import model_fingerprint_key as m, chained_block_hashes as c;"
            "fp = m('llama-0123456789abcdef', 'int4', 16, codec_params={'group_size': 32}, dtype='float16');"
            "print(fp, *c(list(range(40)), 16, fp))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.split()
    assert out == [FP, *chained_block_hashes(list(range(40)), 16, FP)]


@pytest.mark.parametrize("call, field", [
    (lambda: model_fingerprint_key("", "int4", 16), "fingerprint"),
    (lambda: model_fingerprint_key("m", None, 16), "codec"),
    (lambda: model_fingerprint_key("m", "int4", 0), "block_tokens"),
    (lambda: model_fingerprint_key("m", "int4", True), "block_tokens"),
    (lambda: model_fingerprint_key("m", "int4", 16, extra={"x": object()}), "extra"),
    (lambda: chained_block_keys(ids(32), 0, 2, FP), "block_tokens"),
    (lambda: chained_block_keys(ids(32), 16, 0, FP), "layer_count"),
    (lambda: chained_block_keys(ids(32), 16, 2, ""), "fp"),
    (lambda: chained_block_keys(ids(32).reshape(1, 32), 16, 2, FP), "token_ids"),
    (lambda: chained_block_keys(torch.rand(32), 16, 2, FP), "token_ids"),
    (lambda: chained_block_keys([1.5, 2.0], 16, 2, FP), "token_ids"),
    (lambda: chained_block_keys([-1] * 16, 16, 2, FP), "token_ids"),
    (lambda: chained_block_hashes(ids(32), 16, FP, parent="abc"), "parent"),
    (lambda: block_key(FP, -1, "00"), "layer"),
])
def test_bad_input_names_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call()


def test_keys_are_pinned_across_releases():
    # blocks written to L3/Redis by an earlier kvtier of this identity scheme (v2) must be found
    # again: the hash format is frozen
    fp = model_fingerprint_key("llama-0123456789abcdef", "int4", 16, codec_params={"group_size": 32},
                               dtype="float16")
    assert fp == "m4fbce9eb3e598fa9c3661c5b6e21b4d4"
    assert chained_block_hashes(list(range(40)), 16, fp) == [
        "25f5aed036e01811d54296c5e2be44a3", "90e8852f357dee4252c49fd0f16adf23"]


def test_keys_of_the_previous_identity_scheme_never_match():
    # the v1 scheme named a model by its architecture config alone (every fine-tune shared it):
    # its keys, as that release pinned them, are never produced by this one, so its records are
    # misses (recomputed), never served
    v1_fp, v1_hashes = "m5b55068bf538f1f342832a511adbb73f", [
        "57adbcea96914c7c2fd4787f916fdecc", "95b2a00af4e5123d36e7e7ce530b5062"]
    fp = model_fingerprint_key("llama-0123456789abcdef", "int4", 16, codec_params={"group_size": 32},
                               dtype="float16")
    assert fp != v1_fp
    assert not set(chained_block_hashes(list(range(40)), 16, fp)) & set(v1_hashes)
    assert not set(chained_block_hashes(list(range(40)), 16, v1_fp)) & set(v1_hashes)
