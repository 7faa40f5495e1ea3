"""Bounded L3: eviction order (lru/lfu), pins, the owner's keep, second-touch admission, and the
20-conversation trace of bench_l3_cap.py staying under its cap."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from kvtier.tiers import DiskTier
from kvtier.tiers.disk.pins import PinFile

V = bytes(4000)  # a record of ~4 KiB


def tier(path, eviction="lru", admission="always", cap=256 << 10):
    return DiskTier(str(path), capacity_bytes=cap, segment_bytes=32 << 10, durability="never",
                    eviction=eviction, admission=admission)


def key(i: int, layer: int = 0) -> str:
    return f"m0/{layer}/{i:032x}"


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_eviction_keeps_under_cap_and_keeps_the_used_record(tmp_path, eviction):
    t = tier(tmp_path / "l3", eviction)
    assert t.put(key(0), V)
    most = 0
    for i in range(1, 300):
        assert t.put(key(i), V), i  # never refused: something unpinned can always go
        assert t.get(key(0)) == V  # read every time: the last to go under lru and lfu alike
        most = max(most, t.disk_bytes)
    st = t.stats()
    assert most <= t.capacity_bytes
    assert st["evictions"] > 0 and st["used_bytes"] <= t.evict_high_bytes
    assert st["evictions"] + len(t) == 300
    assert not t.contains(key(1))  # the oldest never read again went first
    t.close()


def test_lfu_keeps_the_frequent_record_lru_does_not(tmp_path):
    out = {}
    for ev in ("lru", "lfu"):
        t = tier(tmp_path / ev, ev)
        t.put(key(0), V)
        for _ in range(20):
            t.get(key(0))  # read often, then never again
        for i in range(1, 300):
            t.put(key(i), V)
        out[ev] = t.contains(key(0))
        t.close()
    assert out == {"lru": False, "lfu": True}


def test_pinned_and_kept_records_are_never_evicted_and_pins_reach_an_open_tier(tmp_path):
    path = tmp_path / "l3"
    t = tier(path)
    t.set_keep(lambda keys: [k.endswith("5") for k in keys])  # the owner's records in use
    t.put(key(1), V)
    t.put(key(1, layer=3), V)
    PinFile(str(path)).add("sys", [key(1)])  # pinned while the tier is open: every layer of block 1
    for i in range(2, 300):
        assert t.put(key(i), V)
    assert t.contains(key(1)) and t.contains(key(1, layer=3))
    assert all(t.contains(key(i)) for i in (5, 0x15, 0x25))
    assert t.pinned(key(1, layer=7)) and not t.pinned(key(2))
    assert t.expire(max_age_s=0) > 0 and t.contains(key(1))  # expiry spares pins too
    PinFile(str(path)).remove("sys")
    with pytest.raises(ValueError, match="no pin labelled 'sys'"):
        PinFile(str(path)).remove("sys")
    t.close()


def test_a_tier_where_everything_is_kept_refuses_instead_of_evicting(tmp_path):
    t = tier(tmp_path / "l3")
    t.set_keep(lambda keys: [True] * len(keys))
    oks = [t.put(key(i), V) for i in range(300)]
    assert False in oks and t.stats()["evictions"] == 0
    assert all(t.get(key(i)) == V for i, ok in enumerate(oks) if ok)
    t.close()


def test_second_touch_writes_a_block_only_when_offered_again(tmp_path):
    t = tier(tmp_path / "l3", admission="second-touch")
    assert t.offer_many([(key(1), V), (key(1, 1), V)]) == [None, None]
    assert len(t) == 0 and t.stats()["bytes_written"] == 0
    assert t.offer_many([(key(1), V), (key(1, 1), V)]) == [True, True]
    assert t.get(key(1)) == V
    assert t.offer_many([(key(1), b"other")]) == [True]  # stored already: kept as it is
    assert t.get(key(1)) == V
    assert t.put(key(2), V)  # put_many is not subject to admission
    st = t.stats()
    assert (st["offered"], st["admission_refused"]) == (5, 2)
    t.close()


def test_bad_policy_names_raise_valueerror(tmp_path):
    with pytest.raises(ValueError, match="eviction must be one of"):
        tier(tmp_path / "a", eviction="fifo")
    with pytest.raises(ValueError, match="admission must be one of"):
        tier(tmp_path / "b", admission="twice")
    from kvtier import KVTierConfig
    with pytest.raises(ValueError, match="disk_admission"):
        KVTierConfig(disk_admission="sometimes")


def test_twenty_conversation_trace_stays_under_quarter_cap_and_keeps_the_pinned_prompt(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "bench_l3_cap", os.path.join(os.path.dirname(__file__), "..", "..", "bench", "bench_l3_cap.py"))
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # (its dataclass looks its module up)
    spec.loader.exec_module(bench)
    trace = bench.make_trace(20)
    res = {}
    for adm in ("always", "second-touch"):
        r = bench.run(trace, str(tmp_path / adm), "lru", adm, layers=2, block_bytes=2048)
        assert r["cap"] * 4 <= r["working"] + 4096  # a quarter of the working set
        assert r["most_disk"] <= r["cap"] and r["pinned"] and r["evictions"] > 0
        assert 0 < r["hit_rate"] < 1
        res[adm] = r
    assert res["second-touch"]["refused"] > 0
    assert res["second-touch"]["record_bytes"] < res["always"]["record_bytes"]
