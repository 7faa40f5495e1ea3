"""RemoteTier (L4) against a real redis-server on loopback."""
from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time

import hypothesis.strategies as st
import pytest
import redis
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvtier.tiers import Tier, TierClosedError
from kvtier.tiers.remote import HEADER_BYTES, MAGIC, RemoteTier, check_url, frame, unframe

LOGGER = "kvtier.tiers.remote"


@pytest.fixture
def tier(redis_url):
    t = RemoteTier(redis_url, key_prefix="t:", retry_interval_s=0.2)
    yield t
    t.close()


@pytest.fixture
def raw(redis_url):
    r = redis.Redis.from_url(redis_url)
    yield r
    r.close()


def test_put_get_overwrite_delete_keys(tier):
    assert isinstance(tier, Tier) and tier.used_bytes == 0 and len(tier) == 0
    payload = os.urandom(3000)
    assert tier.put("a", payload) is True
    assert tier.put("b", torch.arange(10, dtype=torch.int16)) is True
    assert bytes(tier.get("a")) == payload
    assert bytes(tier.get("b")) == torch.arange(10, dtype=torch.int16).numpy().tobytes()
    assert tier.put("a", b"short") and bytes(tier.get("a")) == b"short"
    assert sorted(tier.keys()) == ["a", "b"] and len(tier) == 2
    assert tier.contains("a") and "b" in tier and not tier.contains("zz")
    assert tier.used_bytes == 2 * HEADER_BYTES + 5 + 20
    assert tier.delete("a") is True and tier.delete("a") is False
    assert tier.get("a") is None and list(tier.keys()) == ["b"]
    assert tier.used_bytes == HEADER_BYTES + 20


def test_get_hands_back_owned_bytes(tier):
    src = bytearray(b"x" * 100)
    tier.put("k", src)
    src[:] = b"y" * 100
    got = tier.get("k")
    tier.put("k", b"z" * 100)
    assert bytes(got) == b"x" * 100


def test_batched_calls_are_one_round_trip(tier, monkeypatch):
    tier.put("warm", b"w") and tier.delete("warm")  # the server has loaded the scripts
    sends = []
    real = redis.connection.AbstractConnection.send_packed_command
    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command",
                        lambda self, *a, **kw: (sends.append(1), real(self, *a, **kw))[1])
    items = [(f"k{i}", bytes([i]) * (i * 100 + 1)) for i in range(50)]
    assert tier.put_many(items) == [True] * 50
    got = tier.get_many([k for k, _ in items] + ["missing"])
    assert [bytes(g) for g in got[:-1]] == [v for _, v in items] and got[-1] is None
    assert tier.delete_many(["k0", "k1", "missing"]) == [True, True, False]
    assert len(sends) == 3
    monkeypatch.undo()
    assert len(tier) == 48


def test_contains_many_is_one_round_trip(tier, raw, monkeypatch):
    """A batched existence check (prefix lookup asks about every layer's block at once)."""
    tier.put_many([(f"k{i}", bytes([i])) for i in range(40)])
    other = RemoteTier(tier.url, key_prefix="other:")
    other.put("k40", b"x")  # another namespace's key is not this tier's
    raw.set(b"t:k41", b"not a kvtier frame")  # presence only, as contains(): get() calls it a miss
    keys = [f"k{i}" for i in range(45)] + ["k3", "k3"]
    sends = []
    real = redis.connection.AbstractConnection.send_packed_command
    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command",
                        lambda self, *a, **kw: (sends.append(1), real(self, *a, **kw))[1])
    got = tier.contains_many(keys)
    assert len(sends) == 1
    assert tier.contains_many([]) == [] and len(sends) == 1  # nothing asked, nothing sent
    monkeypatch.undo()
    assert got == [i < 40 or i == 41 for i in range(45)] + [True, True]
    assert got == [tier.contains(k) for k in keys]
    big = [f"k{i}" for i in range(1300)]  # more than one chunk of keys
    assert tier.contains_many(big) == [i < 40 or i == 41 for i in range(1300)]
    assert tier.stats()["gets"] == 0  # an existence check is not a read
    other.close()


def test_large_batches_are_chunked(tier):
    items = [(f"k{i}", i.to_bytes(4, "little")) for i in range(1300)]  # > one script call's 512 keys
    assert tier.put_many(items) == [True] * 1300
    assert [bytes(g) for g in tier.get_many([k for k, _ in items])] == [v for _, v in items]
    assert tier.used_bytes == 1300 * (HEADER_BYTES + 4)
    assert tier.delete_many([k for k, _ in items]) == [True] * 1300
    assert tier.used_bytes == 0 and len(tier) == 0


def test_namespaces_are_disjoint_and_share_accounting_across_clients(redis_url):
    a1, a2 = RemoteTier(redis_url, key_prefix="a:"), RemoteTier(redis_url, key_prefix="a:")
    b = RemoteTier(redis_url, key_prefix="b:")
    a1.put("k", b"one")
    assert bytes(a2.get("k")) == b"one" and b.get("k") is None and list(b.keys()) == []
    assert a2.used_bytes == a1.used_bytes == HEADER_BYTES + 3 and b.used_bytes == 0
    # glob characters in a prefix are taken literally
    star = RemoteTier(redis_url, key_prefix="*")
    assert list(star.keys()) == []
    for t in (a1, a2, b, star):
        t.close()


def test_quota_full_returns_false_and_changes_nothing(redis_url):
    t = RemoteTier(redis_url, key_prefix="q:", capacity_bytes=1000)
    assert t.capacity_bytes == 1000
    assert t.put_many([(f"k{i}", b"v" * 184) for i in range(6)]) == [True] * 5 + [False]
    assert t.used_bytes == 1000 and t.get("k5") is None
    assert t.put("k0", b"w" * 184) is True  # overwrite in place fits
    assert t.put("k0", b"w" * 185) is False and bytes(t.get("k0")) == b"w" * 184
    assert t.delete("k1") and t.put("k5", b"v" * 184)
    with pytest.raises(ValueError, match="value"):
        t.put("big", b"x" * 1000)
    assert t.stats()["rejected"] == 2
    t.close()


def test_server_refusal_oom_is_false_not_an_error(redis_server_factory, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    srv = redis_server_factory("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    t = RemoteTier(srv.url)
    assert t.capacity_bytes == 2 << 20 and t.stats()["server_maxmemory_policy"] == "noeviction"
    results = [t.put(f"k{i}", os.urandom(64 << 10)) for i in range(64)]
    assert any(results) and results[-1] is False  # the server filled up and said so
    assert t.stats()["errors"] == results.count(False) and t.connected
    assert t.get(f"k{results.index(True)}") is not None
    refused = [r for r in caplog.records if "refused" in r.message]
    assert len(refused) == 1 and "maxmemory" in refused[0].message  # one warning, not one per put
    t.close()


def test_corrupt_or_foreign_values_are_misses(tier, raw, caplog):
    payload = os.urandom(256)
    tier.put_many([("flip", payload), ("short", payload), ("moved", payload)])
    v = bytearray(raw.get(b"t:flip"))
    v[HEADER_BYTES + 17] ^= 0x01
    raw.set(b"t:flip", bytes(v))
    raw.set(b"t:short", raw.get(b"t:short")[:-1])
    raw.set(b"t:garbage", b"not a kvtier record at all")
    raw.set(b"t:empty", b"")
    raw.set(b"t:moved2", raw.get(b"t:moved"))  # a valid frame under another key: its CRC covers the key
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = tier.get_many(["flip", "short", "garbage", "empty", "moved2", "moved"])
    assert got[:5] == [None] * 5 and bytes(got[5]) == payload
    assert tier.stats()["corrupt"] == 5
    warned = [r.message for r in caplog.records if "failed their frame/CRC check" in r.message]
    assert len(warned) == 1 and "5 value(s)" in warned[0]


def test_frame_roundtrip_and_checks():
    f = frame("key", memoryview(b"abc"))
    assert f[:4] == MAGIC and len(f) == HEADER_BYTES + 3
    assert bytes(unframe("key", f)) == b"abc"
    assert unframe("other", f) is None and unframe("key", None) is None and unframe("key", f[:10]) is None
    assert unframe("key", f[:4] + b"\x09\x00" + f[6:]) is None  # unknown version


def test_server_killed_degrades_to_misses_and_restart_recovers(redis_server, caplog):
    t = RemoteTier(redis_server.url, key_prefix="o:", socket_timeout_s=0.5, retry_interval_s=0.3)
    assert t.put_many([("a", b"1"), ("b", b"2")]) == [True, True]
    redis_server.kill()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        t0 = time.monotonic()
        for _ in range(50):  # a decode loop hammering a dead server: nothing raises
            assert t.get("a") is None
            assert t.put("c", b"3") is False
            assert t.get_many(["a", "b"]) == [None, None]
            assert t.put_many([("d", b"4")]) == [False]
            assert t.delete("a") is False and t.contains("a") is False
            assert t.contains_many(["a", "b"]) == [False, False]
            assert list(t.keys()) == []
        elapsed = time.monotonic() - t0
        s = t.stats()  # stats work during an outage too
    assert not t.connected and s["connected"] is False and s["outages"] == 1
    assert s["skipped"] > 0 and s["errors"] >= 1 and s["misses"] >= 150
    # one warning per outage, not one per call
    down = [r for r in caplog.records if "unreachable" in r.message]
    assert len(down) == 1 and redis_server.url.split("//")[1].split("/")[0] in down[0].message
    # the dead server was tried at most once per retry interval (plus the first failure)
    assert s["errors"] <= 2 + elapsed / 0.3
    json.dumps(s)

    redis_server.restart()  # no persistence: the server comes back empty
    time.sleep(0.35)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert t.put("a", b"again") is True
    assert t.connected and bytes(t.get("a")) == b"again" and t.get("b") is None
    assert any("reachable again" in r.message for r in caplog.records)
    # a second outage is reported again
    redis_server.kill()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        time.sleep(0.35)
        assert t.get("a") is None and t.get("a") is None
    assert sum("unreachable" in r.message for r in caplog.records) == 1 and t.stats()["outages"] == 2
    t.close()


def test_black_holed_server_blocks_at_most_one_timeout_per_retry_interval(caplog):
    # a server that accepts connections and never answers (hung host, dropped packets)
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(64)
        url = f"redis://127.0.0.1:{hole.getsockname()[1]}/0"
        t = RemoteTier(url, socket_timeout_s=0.2, retry_interval_s=30.0)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            t0 = time.monotonic()
            assert t.get("a") is None
            first = time.monotonic() - t0
            t0 = time.monotonic()
            for _ in range(200):
                assert t.get("a") is None and t.put("a", b"x") is False
            rest = time.monotonic() - t0
        assert 0.15 < first < 2.0  # one socket timeout (generous bound for a loaded machine)
        assert rest < first  # later calls within the retry interval never touch the network
        assert "TimeoutError" in caplog.records[0].message and not t.connected
        t.close()


def test_restart_without_outage_noticed_reconnects_at_once(redis_server):
    # the server restarts between two calls: the pooled socket is dead, the next call reconnects
    t = RemoteTier(redis_server.url, retry_interval_s=60.0)
    assert t.put("a", b"1")
    redis_server.restart()
    assert t.put("a", b"2") is True and bytes(t.get("a")) == b"2" and t.stats()["outages"] == 0
    t.close()


def test_unreachable_at_construction_is_not_an_error(redis_server):
    redis_server.kill()
    t = RemoteTier(redis_server.url, retry_interval_s=0.1)
    assert t.get("a") is None and t.put("a", b"x") is False and t.capacity_bytes == 0
    redis_server.start()
    time.sleep(0.15)
    assert t.put("a", b"x") is True and t.capacity_bytes > 0
    t.close()


_CHILD = textwrap.dedent("""
    import sys, json, time
    from kvtier.tiers.remote import RemoteTier
    url, role = sys.argv[1], sys.argv[2]
    t = RemoteTier(url, key_prefix="shared:")
    if role == "write":
        ok = t.put_many([(f"blk{i}", bytes([i]) * 1024) for i in range(20)])
        ok += [t.put("done", b"1")]
        print(json.dumps({"ok": all(ok), "used": t.used_bytes}))
    else:
        deadline = time.monotonic() + 60
        while t.get("done") is None:  # the other "host" is still computing the prefix
            assert time.monotonic() < deadline, "writer never finished"
            time.sleep(0.01)
        got = t.get_many([f"blk{i}" for i in range(20)] + ["nope"])
        print(json.dumps({"match": all(bytes(g) == bytes([i]) * 1024 for i, g in enumerate(got[:20])),
                          "last": got[20] is None, "hits": t.stats()["hits"]}))
    t.close()
""")


@pytest.mark.slow  # starts Python processes that import torch
def test_two_processes_share_one_server(redis_url):
    # two OS processes stand in for two hosts, started together; the reader waits for the writer
    procs = {role: subprocess.Popen([sys.executable, "-c", _CHILD, redis_url, role], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for role in ("read", "write")}
    res = {}
    for role, p in procs.items():
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        res[role] = json.loads(out)
    assert res["write"]["ok"] and res["write"]["used"] == 20 * (HEADER_BYTES + 1024) + HEADER_BYTES + 1
    assert res["read"]["match"] and res["read"]["last"] and res["read"]["hits"] == 21
    # and this process sees the same namespace and accounting
    t = RemoteTier(redis_url, key_prefix="shared:")
    assert len(t) == 21 and t.used_bytes == res["write"]["used"]
    t.close()


def test_stats_fields(tier):
    tier.put("a", b"abc")
    tier.put("b", b"de")
    tier.get("a")
    tier.get("nope")
    s = tier.stats()
    json.dumps(s)
    assert (s["puts"], s["gets"], s["hits"], s["misses"], s["bytes_in"], s["bytes_out"]) == (2, 2, 1, 1, 5, 3)
    assert s["records"] == 2 and s["used_bytes"] == 2 * HEADER_BYTES + 5 and s["connected"] is True
    assert 0 < s["latency_p50_ms"] <= s["latency_p99_ms"] and s["errors"] == 0
    assert s["server_used_memory"] > 0 and s["capacity_bytes"] > 0  # maxmemory 0: the server's RAM


def test_resync_after_server_side_eviction(tier, raw):
    tier.put_many([("a", b"x" * 100), ("b", b"y" * 50)])
    raw.delete(b"t:a")  # as the server's maxmemory policy would
    assert tier.used_bytes == 2 * HEADER_BYTES + 150
    assert tier.resync() == HEADER_BYTES + 50 == tier.used_bytes


def test_closed_tier_refuses_use(redis_url):
    t = RemoteTier(redis_url)
    t.put("a", b"1")
    t.close()
    for call in (lambda: t.put("b", b"2"), lambda: t.get("a"), lambda: t.delete("a"), lambda: t.stats(),
                 lambda: t.contains_many(["a"])):
        with pytest.raises(TierClosedError):
            call()
    t.close()


@pytest.mark.parametrize("url", [
    "", "localhost:6379", "http://localhost:6379/0", "redis://", "redis://host:99999/0",
    "redis://host:6379/zero", "unix://", 6379, None,
])
def test_bad_url_names_url_and_the_form(url):
    with pytest.raises(ValueError, match=r"url must look like redis://"):
        RemoteTier(url)


def test_good_urls_and_redacted_password():
    for u in ("redis://127.0.0.1:6379/0", "redis://h", "rediss://u:p@h:1/2", "unix:///tmp/r.sock?db=1"):
        assert check_url(u) == u
    with pytest.raises(ValueError) as e:
        check_url("redis://user:s3cret@host:6379/x")
    assert "s3cret" not in str(e.value)
    assert "s3cret" not in repr(RemoteTier("redis://user:s3cret@host:6379/0"))


@pytest.mark.parametrize("kw, field", [
    (dict(key_prefix="a\x00b"), "key_prefix"), (dict(key_prefix=3), "key_prefix"),
    (dict(socket_timeout_s=0), "socket_timeout_s"), (dict(socket_timeout_s=float("nan")), "socket_timeout_s"),
    (dict(retry_interval_s=-1), "retry_interval_s"), (dict(capacity_bytes=0), "capacity_bytes"),
    (dict(capacity_bytes=True), "capacity_bytes"), (dict(latency_window=0), "latency_window"),
])
def test_bad_arguments_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        RemoteTier("redis://127.0.0.1:1/0", **kw)


def test_bad_keys_and_values_raise_before_any_network(redis_server):
    redis_server.kill()  # nothing must be sent: validation happens first
    t = RemoteTier(redis_server.url)
    for key in (None, "", "a\x00b", "x" * 256):
        with pytest.raises(ValueError, match="key"):
            t.put(key, b"x")
        with pytest.raises(ValueError, match="key"):
            t.get_many(["ok", key])
        with pytest.raises(ValueError, match="key"):
            t.contains_many(["ok", key])
    with pytest.raises(ValueError, match="value"):
        t.put("k", "a str")
    s = t.stats()
    assert s["puts"] == 0 and s["gets"] == 0


KEYS = st.sampled_from([f"k{i}" for i in range(10)])
VALUES = st.tuples(st.integers(0, 1500), st.binary(min_size=1, max_size=8)).map(
    lambda t: (t[1] * (t[0] // len(t[1]) + 1))[: t[0]])
QUOTA = 6000


class RemoteMachine(RuleBasedStateMachine):
    """RemoteTier against a dict, quota decisions predicted exactly; reconnecting (a new client,
    as another process would be) keeps everything. ``tests/tiers/test_mooncake.py`` runs the same
    machine on MooncakeTier."""

    url = ""
    namespaces = itertools.count()

    def __init__(self):
        super().__init__()
        self.prefix = f"sm{next(self.namespaces)}:"
        self.tier = self.open()
        self.model: dict[str, bytes] = {}

    def open(self) -> Tier:
        """A client of the namespace under test (the Mooncake machine opens a MooncakeTier)."""
        return RemoteTier(self.url, key_prefix=self.prefix, capacity_bytes=QUOTA)

    def _used(self, model) -> int:
        return sum(len(v) + HEADER_BYTES for v in model.values())

    def _predict_puts(self, items) -> list[bool]:
        out = []
        for key, value in items:
            old = len(self.model[key]) + HEADER_BYTES if key in self.model else 0
            fits = self._used(self.model) - old + len(value) + HEADER_BYTES <= QUOTA
            if fits:
                self.model[key] = value
            out.append(fits)
        return out

    @rule(key=KEYS, value=VALUES)
    def put(self, key, value):
        expect = self._predict_puts([(key, value)])
        assert [self.tier.put(key, value)] == expect

    @rule(items=st.lists(st.tuples(KEYS, VALUES), max_size=6))
    def put_many(self, items):
        expect = self._predict_puts(items)
        assert self.tier.put_many(items) == expect

    @rule(keys=st.lists(KEYS, max_size=4, unique=True))
    def delete_many(self, keys):
        assert self.tier.delete_many(keys) == [k in self.model for k in keys]
        for k in keys:
            self.model.pop(k, None)

    @rule(keys=st.lists(KEYS, max_size=5))
    def get_many(self, keys):
        got = self.tier.get_many(keys)
        assert [None if g is None else bytes(g) for g in got] == [self.model.get(k) for k in keys]

    @rule(keys=st.lists(KEYS, max_size=6))
    def contains_many(self, keys):
        assert self.tier.contains_many(keys) == [k in self.model for k in keys]

    @rule()
    def reconnect(self):
        self.tier.close()
        self.tier = self.open()

    @invariant()
    def matches_model(self):
        assert sorted(self.tier.keys()) == sorted(self.model)
        assert self.tier.used_bytes == self._used(self.model) <= QUOTA

    def teardown(self):
        self.tier.close()


def test_state_machine_against_a_dict(redis_url):
    RemoteMachine.url = redis_url
    run_state_machine_as_test(RemoteMachine, settings=settings(max_examples=40, stateful_step_count=30,
                                                               deadline=None))
