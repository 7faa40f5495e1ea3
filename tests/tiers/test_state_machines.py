"""Each tier checked against a plain dict by a Hypothesis state machine.

HostTier's machine also checks what the ring hands to ``spill``: exactly the oldest live records,
oldest first, with the bytes last put (so wrap-around and batching are covered); DiskTier's
reopens the directory and compacts between steps.
"""
from __future__ import annotations

import shutil
import tempfile
import threading

import hypothesis.strategies as st
import torch
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.tiers import DeviceTier, DiskTier, HostTier

KEYS = st.sampled_from([f"k{i}" for i in range(12)])


def values(max_size: int) -> st.SearchStrategy[bytes]:
    """Bytes of any length up to max_size (plain st.binary() stays tiny, so rings never wrap)."""
    return st.tuples(st.integers(0, max_size), st.binary(min_size=1, max_size=16)).map(
        lambda t: (t[1] * (t[0] // len(t[1]) + 1))[: t[0]])
SETTINGS = settings(max_examples=40, stateful_step_count=40, deadline=None)


class DictModelMachine(RuleBasedStateMachine):
    """The delete and get rules of a tier (``self.tier``) checked against a plain dict
    (``self.model``); subclasses add their puts, ``check_hit`` for more on a hit, and may
    replace ``delete`` with a rule of their own."""

    tier: DeviceTier | HostTier | DiskTier
    model: dict[str, bytes]

    @rule(key=KEYS)
    def delete(self, key):
        assert self.tier.delete(key) == (key in self.model)
        self.model.pop(key, None)

    @rule(key=KEYS)
    def get(self, key):
        got = self.tier.get(key)
        assert (got is None) == (key not in self.model)
        if got is not None:
            assert got == self.model[key]
            self.check_hit(key, got)

    def check_hit(self, key, got):
        """Further checks of a hit's value ``got`` (none by default)."""


class DeviceMachine(DictModelMachine):
    def __init__(self):
        super().__init__()
        self.tier = DeviceTier((64,), num_slots=6, dtype=torch.uint8)
        self.model: dict[str, bytes] = {}
        self.fences: list[threading.Event] = []

    @rule(key=KEYS, value=values(64))
    def put(self, key, value):
        ok = self.tier.put(key, value)
        if ok:
            self.model[key] = value
        else:  # full: only when no slot can be handed out
            assert self.tier.free_slots == 0

    @rule(key=KEYS, fenced=st.booleans())
    def delete(self, key, fenced):  # replaces the base rule: a delete may wait on a copy's fence
        fence = None
        if fenced:
            fence = threading.Event()
            self.fences.append(fence)
        assert self.tier.delete(key, fence=fence) == (key in self.model)
        self.model.pop(key, None)

    @rule(key=KEYS)
    def mark_pending(self, key):
        if key in self.model:
            ev = threading.Event()
            self.fences.append(ev)
            self.tier.mark_pending(key, ev)

    @rule()
    def complete_oldest_copy(self):
        if self.fences:
            self.fences.pop(0).set()

    @invariant()
    def accounting(self):
        t = self.tier
        assert sorted(t.keys()) == sorted(self.model)
        assert len(t) + t.free_slots + t.pending_slots == t.num_slots
        slots = [t.slot_of(k) for k in self.model]
        assert len(set(slots)) == len(slots)  # no two keys share a slot

    def teardown(self):
        event(f"device pending slots seen: {bool(self.fences)}")
        self.tier.close()


class HostMachine(DictModelMachine):
    def __init__(self):
        super().__init__()
        self.spilled: dict[str, bytes] = {}
        self.fail_spill = False
        self.with_spill = True
        self.tier = HostTier(4096, spill=self._spill, spill_batch_bytes=700)
        self.model: dict[str, bytes] = {}  # insertion order == ring order (oldest first)
        self.wrapped = False

    def _spill(self, batch):
        if self.fail_spill:
            raise OSError("next tier unavailable")
        keys = [k for k, _ in batch]
        assert keys == list(self.model)[: len(keys)], "spill must hand the oldest live records first"
        for k, mv in batch:
            assert bytes(mv) == self.model[k]
            self.spilled[k] = bytes(mv)
            del self.model[k]

    @rule(key=KEYS, value=values(2000))
    def put(self, key, value):
        before = dict(self.model)
        ok = self.tier.put(key, value)
        if ok and self.tier._log[-1][0] == 0 and len(self.tier._log) > 1:
            self.wrapped = True
        if ok:
            self.model.pop(key, None)
            self.model[key] = value
        else:
            assert self.fail_spill or not self.with_spill
            if not self.with_spill:  # refused only when the live records really fill the arena
                need = self.tier.record_bytes(key, len(value))
                assert self.tier.used_bytes + need > self.tier.capacity_bytes
            assert self.model == before  # whatever was not handed over is still here

    def check_hit(self, key, got):
        out = bytearray(len(got) + 3)  # get_into a caller's larger buffer reads the same bytes
        assert self.tier.get_into(key, out) == len(got) and bytes(out[: len(got)]) == got

    @rule(fail=st.sampled_from([False, False, False, True]), attached=st.sampled_from([True, True, True, False]))
    def set_next_tier(self, fail, attached):
        """The next tier fails, or is detached altogether (then a full ring refuses puts)."""
        self.fail_spill = fail
        self.with_spill = attached
        self.tier.spill = self._spill if attached else None

    @invariant()
    def matches_model(self):
        assert list(self.tier.keys()) == list(self.model)
        assert self.tier.used_bytes == sum(self.tier.record_bytes(k, len(v)) for k, v in self.model.items())
        assert self.tier.used_bytes <= self.tier.capacity_bytes

    def teardown(self):
        event(f"host ring wrapped: {self.wrapped}")
        event(f"host spills: {min(self.tier.stats()['spills'], 3)}+")
        event(f"host defragments: {min(self.tier.stats()['defragments'], 1)}+")
        self.tier.close()


class HostNoNextTierMachine(HostMachine):
    """The ring on its own: puts fail only when live records fill it (holes get defragmented)."""

    def __init__(self):
        super().__init__()
        self.with_spill = False
        self.tier.spill = None

    def set_next_tier(self, fail, attached):  # not a rule here: there is no next tier
        raise AssertionError("unreachable")


class DiskMachine(DictModelMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvtier-sm-")
        self.tier = self._open()
        self.model: dict[str, bytes] = {}

    def _open(self):
        return DiskTier(self.dir + "/l3", capacity_bytes=6 * 4096, segment_bytes=4096,
                        durability="close", compact_threshold=0.5)

    @rule(key=KEYS, value=values(1200))
    def put(self, key, value):
        if self.tier.put(key, value):
            self.model[key] = value

    @rule(items=st.lists(st.tuples(KEYS, values(600)), max_size=5))
    def put_many(self, items):
        for (key, value), ok in zip(items, self.tier.put_many(items)):
            if ok:
                self.model[key] = value

    @rule()
    def reopen(self):
        self.tier.close()
        self.tier = self._open()

    @rule()
    def compact(self):
        self.tier.compact()

    @invariant()
    def matches_model(self):
        assert sorted(self.tier.keys()) == sorted(self.model)
        s = self.tier.stats()
        assert s["corrupt"] == 0 and s["scan_corrupt"] == 0
        assert s["disk_bytes"] <= s["capacity_bytes"]

    def teardown(self):
        event(f"disk compactions: {min(self.tier.stats()['compactions'], 3)}+")
        self.tier.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestDeviceMachine = DeviceMachine.TestCase
TestDeviceMachine.settings = SETTINGS
TestHostMachine = HostMachine.TestCase
TestHostMachine.settings = settings(SETTINGS, max_examples=60, stateful_step_count=60)
TestHostNoNextTierMachine = HostNoNextTierMachine.TestCase
TestHostNoNextTierMachine.settings = settings(SETTINGS, stateful_step_count=60)
TestDiskMachine = DiskMachine.TestCase
TestDiskMachine.settings = SETTINGS
