"""One suite, every tier: the Tier contract from kvtier/tiers/base.py."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from kvtier.tiers import MAX_KEY_BYTES, Tier, TierClosedError

BAD_KEYS = [None, 3, b"bytes", "", "a\x00b", "x" * (MAX_KEY_BYTES + 1), "é" * 128]


def test_is_a_tier(tier):
    assert isinstance(tier, Tier)
    assert tier.capacity_bytes > 0 and tier.used_bytes == 0 and len(tier) == 0


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "tensor", "ndarray"])
def test_roundtrip_bytes_like(tier, spec, kind):
    raw = os.urandom(spec.max_value)
    value = {"bytes": raw, "bytearray": bytearray(raw), "memoryview": memoryview(raw),
             "tensor": torch.frombuffer(bytearray(raw), dtype=torch.uint8),
             "ndarray": np.frombuffer(raw, dtype=np.uint8)}[kind]
    assert tier.put("k", value) is True
    assert bytes(tier.get("k")) == raw


def test_empty_value_and_longest_key(tier):
    key = "k" * MAX_KEY_BYTES
    assert tier.put(key, b"")
    assert bytes(tier.get(key)) == b""
    assert tier.contains(key)


def test_put_copies_and_get_is_owned(tier, spec):
    src = bytearray(os.urandom(spec.max_value))
    expect = bytes(src)
    tier.put("k", src)
    src[:] = b"\xff" * len(src)  # caller reuses its buffer at once
    got = tier.get("k")
    assert bytes(got) == expect
    tier.put("k", b"\x00" * 8)  # later puts never change what a get handed back
    tier.put("other", b"\x01" * 8)
    assert bytes(got) == expect


def test_overwrite_delete_contains_keys(tier):
    assert tier.put("a", b"one") and tier.put("b", b"two")
    assert tier.put("a", b"three")
    assert bytes(tier.get("a")) == b"three"
    assert sorted(tier.keys()) == ["a", "b"] and len(tier) == 2
    assert "a" in tier and tier.contains("b") and not tier.contains("c")
    assert tier.delete("a") is True
    assert tier.delete("a") is False
    assert tier.get("a") is None and "a" not in tier
    assert list(tier.keys()) == ["b"]


def test_batched_variants(tier):
    items = [(f"k{i}", bytes([i]) * (i + 1)) for i in range(8)]
    assert tier.put_many(items) == [True] * 8
    got = tier.get_many([k for k, _ in items] + ["missing"])
    assert [bytes(g) for g in got[:-1]] == [v for _, v in items] and got[-1] is None
    assert tier.delete_many(["k0", "k1", "missing"]) == [True, True, False]
    assert sorted(tier.keys()) == [f"k{i}" for i in range(2, 8)]


def test_value_size_is_the_stored_length(tier):
    """value_size: the length of the value under a key (None when absent); tiers that override
    the reading default answer from their index, without a get."""
    assert tier.put("a", b"abc") and tier.put("e", b"")
    gets = tier.stats()["gets"]
    assert tier.value_size("a") == 3 and tier.value_size("e") == 0 and tier.value_size("nope") is None
    assert tier.value_sizes(["a", "nope", "e"]) == [3, None, 0]
    assert tier.put("a", b"x" * 10) and tier.value_size("a") == 10
    if type(tier).value_size is not Tier.value_size:
        assert tier.stats()["gets"] == gets


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_bad_keys_raise_value_error(tier, key):
    for call in (lambda: tier.put(key, b"x"), lambda: tier.get(key), lambda: tier.contains(key),
                 lambda: tier.delete(key), lambda: tier.put_many([(key, b"x")])):
        with pytest.raises(ValueError, match="key"):
            call()
    assert len(tier) == 0


def test_bad_value_type_raises(tier):
    with pytest.raises(ValueError, match="value"):
        tier.put("k", 12345)
    with pytest.raises(ValueError, match="value"):
        tier.put("k", "a str is not bytes")


def test_oversize_value_raises_value_error_not_false(tier):
    big = b"\x00" * (tier.capacity_bytes + 1)
    with pytest.raises(ValueError, match="value"):
        tier.put("k", big)
    assert len(tier) == 0 and tier.used_bytes == 0


def test_full_returns_false_and_changes_nothing(tier, spec):
    stored = {}
    for i in range(10_000):
        v = bytes([i % 251]) * spec.fill_value
        if not tier.put(f"k{i}", v):
            break
        stored[f"k{i}"] = v
    else:
        pytest.fail("tier never reported full")
    assert stored, "nothing fitted at all"
    used = tier.used_bytes
    assert 0 < used <= tier.capacity_bytes
    assert tier.put("overflow", b"\x07" * spec.fill_value) is False
    assert tier.get("overflow") is None and tier.used_bytes == used
    assert {k: bytes(tier.get(k)) for k in tier.keys()} == stored
    # deleting makes room again (the disk tier may need its compaction to get it back)
    for k in list(stored)[: max(1, len(stored) // 2 + 1)]:
        assert tier.delete(k)
    assert tier.put("overflow", b"\x07" * spec.fill_value) is True


def test_used_bytes_tracks_records(tier):
    assert tier.used_bytes == 0
    tier.put("a", b"x" * 64)
    one = tier.used_bytes
    assert one >= 64
    tier.put("b", b"y" * 64)
    assert tier.used_bytes == 2 * one
    tier.put("a", b"z" * 64)  # overwrite: same size, same usage
    assert tier.used_bytes == 2 * one
    tier.delete("a")
    tier.delete("b")
    assert tier.used_bytes == 0


def test_stats_exact_and_json(tier):
    tier.put("a", b"abc")
    tier.put("b", b"de")
    tier.get("a")
    tier.get("nope")
    s = tier.stats()
    json.dumps(s)
    for f in ("puts", "gets", "hits", "misses", "bytes_in", "bytes_out", "used_bytes", "capacity_bytes", "records"):
        assert f in s, f
    assert (s["puts"], s["gets"], s["hits"], s["misses"]) == (2, 2, 1, 1)
    assert (s["bytes_in"], s["bytes_out"], s["records"]) == (5, 3, 2)
    assert s["used_bytes"] == tier.used_bytes and s["capacity_bytes"] == tier.capacity_bytes


def test_closed_tier_refuses_use(spec, tmp_path):
    t = spec.make(tmp_path)
    t.put("a", b"1")
    t.close()
    with pytest.raises(TierClosedError):
        t.put("b", b"2")
    with pytest.raises(TierClosedError):
        t.get("a")
    t.close()  # idempotent


def test_context_manager(spec, tmp_path):
    with spec.make(tmp_path) as t:
        t.put("a", b"1")
        assert bytes(t.get("a")) == b"1"


def test_concurrent_threads_keep_every_record_whole(tier, spec):
    import threading

    size = min(spec.max_value, 100)
    errors: list[str] = []

    def worker(w: int) -> None:
        for i in range(200):
            k = f"w{w}-{i % 3}"  # 3 keys per thread, 12 records at most: fits every tier
            v = bytes([w * 16 + i % 16]) * size
            if not tier.put(k, v):
                errors.append(f"put {k} refused")
            got = tier.get(k)
            if got is None or bytes(got) != v:
                errors.append(f"{k}: read back something else")
            if i % 7 == 0:
                tier.delete(k)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(len(bytes(tier.get(k))) == size for k in tier.keys())


def test_get_into_buffer_and_tensor(tier, spec):
    raw = os.urandom(spec.max_value)
    tier.put("k", raw)
    buf = bytearray(spec.max_value + 5)
    assert tier.get_into("k", buf) == len(raw) and bytes(buf[: len(raw)]) == raw
    t = torch.zeros(spec.max_value // 2 + 1, dtype=torch.float16)  # any dtype, seen as bytes
    assert tier.get_into("k", t) == len(raw)
    assert t.view(torch.uint8).numpy().tobytes()[: len(raw)] == raw
    assert tier.get_into("missing", buf) is None
    with pytest.raises(ValueError, match="out"):
        tier.get_into("k", bytearray(len(raw) - 1))
    with pytest.raises(ValueError, match="out"):
        tier.get_into("k", bytes(len(raw)))
    s = tier.stats()
    assert s["hits"] == 2 and s["misses"] == 1 and s["bytes_out"] == 2 * len(raw)
