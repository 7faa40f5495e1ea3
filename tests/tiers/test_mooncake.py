"""MooncakeTier (L4) against a real Mooncake Store on loopback (``mooncake_master`` + a store
server, :mod:`tests.mooncake_server`). The shared conformance suite runs on it too
(``tests/tiers/conftest.py``)."""
from __future__ import annotations

import itertools
import json
import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvtier.config import KVTierConfig
from kvtier.tiers import TierClosedError
from kvtier.tiers.mooncake import MooncakeTier, MooncakeURL
from kvtier.tiers.remote import HEADER_BYTES, RemoteTier
from kvtier.tiers.remotes import open_remote

from tests.mooncake_server import raw_client

from .test_remote import QUOTA, RemoteMachine

LOGGER = "kvtier.tiers.mooncake"
_prefixes = itertools.count()


def _unreachable(records) -> list:
    return [r for r in records if r.name == LOGGER and "unreachable" in r.getMessage()]


@pytest.fixture
def tier(mooncake_shared):
    t = MooncakeTier(mooncake_shared.url, key_prefix=f"mt{next(_prefixes)}:", retry_interval_s=0.1)
    yield t
    t.close()


class MooncakeMachine(RemoteMachine):
    """RemoteMachine's rules (quota predicted exactly, reconnects keep everything) on Mooncake."""

    def open(self):
        return MooncakeTier(self.url, key_prefix=self.prefix, capacity_bytes=QUOTA)


def test_state_machine_against_a_dict(mooncake_shared):
    MooncakeMachine.url = mooncake_shared.url
    run_state_machine_as_test(MooncakeMachine, settings=settings(max_examples=15, stateful_step_count=20,
                                                                 deadline=None))


def test_batches_are_one_round_trip_each(tier, monkeypatch):
    items = [(f"k{i}", os.urandom(3000)) for i in range(40)]
    assert tier.put_many(items) == [True] * 40
    calls = []
    real = tier._result
    monkeypatch.setattr(tier, "_result", lambda codes, t0: calls.append(len(codes)) or real(codes, t0))
    got = tier.get_many([k for k, _ in items] + ["nope"])
    assert [bytes(g) for g in got[:-1]] == [v for _, v in items] and got[-1] is None
    assert tier.contains_many([k for k, _ in items] + ["nope"]) == [True] * 40 + [False]
    assert tier.delete_many(["k0", "k1", "nope"]) == [True, True, False]
    assert calls == [41, 41, 3]


def test_values_larger_than_any_seen_are_read_whole(tier):
    """A read slot is sized by the largest value seen; a larger one (another process's) is read
    again at its own size."""
    small, big = os.urandom(100), os.urandom(3 << 20)
    other = MooncakeTier(tier.url, key_prefix=tier.key_prefix)
    assert other.put("big", big) and tier.put("small", small)
    assert [bytes(g) for g in tier.get_many(["small", "big"])] == [small, big]
    other.close()
    with pytest.raises(ValueError, match="value"):
        tier.put("huge", b"\0" * (tier.max_value_bytes + 1))


def test_corrupt_or_foreign_values_are_misses(tier, mooncake_shared, caplog):
    assert tier.put("good", b"v" * 500) and tier.put("flip", b"w" * 500)
    raw = raw_client(mooncake_shared)
    try:
        assert raw.upsert(tier.key_prefix + "garbage", b"not a frame at all") == 0
        framed = bytearray(raw.get(tier.key_prefix + "flip"))
        framed[HEADER_BYTES + 7] ^= 0x40  # one bit of the payload, as a torn transfer would leave it
        assert raw.upsert(tier.key_prefix + "flip", bytes(framed)) == 0
        # a value framed for another key (copied across keys) fails the key-bound CRC
        assert raw.upsert(tier.key_prefix + "moved", bytes(raw.get(tier.key_prefix + "good"))) == 0
    finally:
        raw.close()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = tier.get_many(["good", "flip", "garbage", "moved"])
    assert bytes(got[0]) == b"v" * 500 and got[1:] == [None, None, None]
    s = tier.stats()
    assert s["corrupt"] == 3 and s["hits"] == 1 and s["misses"] == 3
    assert sum("CRC" in r.getMessage() for r in caplog.records) == 1


def test_pool_full_evicts_and_evicted_records_are_misses(tmp_path_factory):
    """More than the pool holds: the master evicts (leases expired) and what it evicted reads as a
    miss; nothing read is ever other bytes; a put the pool cannot place is False, never an error."""
    from tests.conftest import serve_mooncake

    gen = serve_mooncake(tmp_path_factory, segment_bytes=16 << 20,
                         master_args=("-default_kv_lease_ttl=50", "-eviction_high_watermark_ratio=0.8"))
    pool = next(gen)
    try:
        t = MooncakeTier(pool.url, key_prefix="full:")
        values = {f"k{i}": bytes([i % 251]) * (256 << 10) for i in range(160)}  # 40 MiB into 16 MiB
        oks = []
        for i in range(0, 160, 8):
            oks += t.put_many([(k, values[k]) for k in list(values)[i:i + 8]])
            time.sleep(0.06)  # past the lease of the previous batch
        assert sum(oks) > 60, oks
        got = t.get_many(list(values))
        hits = [k for k, g in zip(values, got) if g is not None]
        assert all(bytes(g) == values[k] for k, g in zip(values, got) if g is not None)
        assert 0 < len(hits) < len(values)
        assert len(t) == len(hits) or len(t) <= len(values)
        assert t.stats()["corrupt"] == 0
        t.close()
    finally:
        gen.close()


def test_master_killed_is_a_miss_then_restart_recovers(mooncake_pool, caplog):
    t = MooncakeTier(mooncake_pool.url, key_prefix="k:", retry_interval_s=0.2)
    assert t.put("a", b"1" * 100) and bytes(t.get("a")) == b"1" * 100
    mooncake_pool.kill_master()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        t0 = time.monotonic()
        for _ in range(50):
            assert t.get("a") is None
            assert t.put("b", b"2") is False
            assert t.contains_many(["a", "b"]) == [False, False]
            assert t.delete("a") is False and list(t.keys()) == []
        assert time.monotonic() - t0 < 5.0  # a down master costs probes, never a client call's stall
        assert len(_unreachable(caplog.records)) == 1
        assert t.connected is False and t.stats()["outages"] == 1
        mooncake_pool.restart_master()
        deadline = time.monotonic() + 15
        while not t.put("c", b"3" * 10) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert bytes(t.get("c")) == b"3" * 10 and t.connected
    assert t.get("a") is None  # a restarted master remembers nothing
    assert len(_unreachable(caplog.records)) == 1
    assert any("reachable again" in r.getMessage() for r in caplog.records)
    t.close()


def test_unreachable_at_construction_is_not_an_error(mooncake_pool, caplog):
    url = mooncake_pool.url
    mooncake_pool.kill()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        t = MooncakeTier(url, key_prefix="u:", retry_interval_s=60)
        t0 = time.monotonic()
        assert t.put("a", b"x") is False and t.get("a") is None and t.contains_many(["a"]) == [False]
        assert time.monotonic() - t0 < 2.0
    assert len(_unreachable(caplog.records)) == 1 and t.stats()["skipped"] == 3
    t.close()


_WRITER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[2])
    from kvtier.tiers.mooncake import MooncakeTier
    t = MooncakeTier(sys.argv[1], key_prefix="two:")
    print(json.dumps(t.put_many([("a", b"from A" * 1000), ("b", b"")])))
    t.close()
""")


def test_two_processes_share_one_pool(mooncake_shared):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _WRITER, mooncake_shared.url, root], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [True, True]
    # the writer has exited: its records live on the store server, and this process reads them
    t = MooncakeTier(mooncake_shared.url, key_prefix="two:")
    assert [None if g is None else bytes(g) for g in t.get_many(["a", "b", "c"])] == [b"from A" * 1000, b"", None]
    t.close()


def test_closed_tier_refuses_use_and_others_keep_the_client(mooncake_shared):
    a = MooncakeTier(mooncake_shared.url, key_prefix="c1:")
    b = MooncakeTier(mooncake_shared.url, key_prefix="c2:")
    assert a.put("x", b"1") and b.put("x", b"2")
    a.close()
    with pytest.raises(TierClosedError):
        a.get("x")
    assert bytes(b.get("x")) == b"2"  # the process's client serves the other tier on
    b.close()


@pytest.mark.parametrize("url, why", [
    ("mooncake://127.0.0.1?metadata=http://h:1/metadata", "RPC_PORT"),
    ("mooncake://127.0.0.1:50051", "metadata"),
    ("mooncake://127.0.0.1:50051?metadata=ftp://h/m", "metadata must be an http"),
    ("mooncake://127.0.0.1:50051?metadata=http://h:1", "metadata must be an http"),
    ("mooncake://127.0.0.1:50051?metadata=http://h:1/m&segment_bytes=1MiB", "segment_bytes must be 0 or at least"),
    ("mooncake://127.0.0.1:50051?metadata=http://h:1/m&buffer_bytes=lots", "buffer_bytes must be a byte count"),
    ("mooncake://127.0.0.1:50051?metadata=http://h:1/m&buffer_bytes=1024", "buffer_bytes must be at least"),
    ("mooncake://127.0.0.1:50051?metadata=http://h:1/m&protocol=udp", "protocol must be one of"),
    ("mooncake://127.0.0.1:50051?metadata=http://h:1/m&segment=1", "unknown parameter 'segment'"),
    ("mooncake://127.0.0.1:50051/x?metadata=http://h:1/m", "no path"),
])
def test_bad_urls_name_remote_url(url, why):
    for make in (lambda: MooncakeURL(url), lambda: KVTierConfig(remote_url=url)):
        with pytest.raises(ValueError, match="remote_url") as e:
            make()
        assert why in str(e.value)


def test_url_defaults_and_dispatch():
    url = "mooncake://10.0.0.5:50051?metadata=http://10.0.0.5:8080/metadata&segment_bytes=1GiB"
    c = MooncakeURL(url)
    assert (c.master, c.admin, c.segment_bytes, c.buffer_bytes, c.protocol) == \
        ("10.0.0.5:50051", "http://10.0.0.5:9003", 1 << 30, 64 << 20, "tcp")
    assert KVTierConfig(remote_url=url).remote_url == url
    t = open_remote(url, key_prefix="p:")
    assert isinstance(t, MooncakeTier) and t.key_prefix == "p:" and t.max_value_bytes == (32 << 20) - HEADER_BYTES
    t.close()
    r = open_remote("redis://127.0.0.1:1/0", key_prefix="p:", redis_timeout_s=2.0)
    assert isinstance(r, RemoteTier) and r.socket_timeout_s == 2.0
    r.close()


def test_used_bytes_of_keys_with_commas_and_escapes(tier):
    """Sizes come from the admin port's batch query (comma-separated, percent-encoded keys);
    keys it cannot answer for are asked of the client one by one."""
    keys = ["a,b", "c%2Cd", "é/ü", "plain"]
    assert all(tier.put_many([(k, b"x" * (10 * (i + 1))) for i, k in enumerate(keys)]))
    assert tier.used_bytes == sum(10 * (i + 1) + HEADER_BYTES for i in range(4))
    assert sorted(tier.keys()) == sorted(keys)
