"""Factories for the tier conformance suite: every tier, small enough to fill in a test."""
from __future__ import annotations

import itertools

import pytest
import torch

from kvtier.tiers import DeviceTier, DiskTier, HostTier, RemoteTier
from tests.mooncake_server import mooncake_unavailable
from tests.redis_server import REDIS_SERVER, start_redis_server

_namespaces = itertools.count()
_SERVER = None  # one real redis-server for the conformance runs of RemoteTier
_POOL = None  # and one Mooncake pool (master + store server) for MooncakeTier's


class Spec:
    """How to build one tier for the shared suite and what it can hold."""

    def __init__(self, name, make, max_value, fill_value):
        self.name, self.make, self.max_value, self.fill_value = name, make, max_value, fill_value


def _device(tmp_path):
    return DeviceTier((128,), num_slots=16, dtype=torch.uint8)


def _host(tmp_path):
    return HostTier(16 << 10, spill=None)


def _disk(tmp_path):
    return DiskTier(tmp_path / "l3", capacity_bytes=32 << 10, segment_bytes=8 << 10, durability="close")


def _remote(tmp_path):
    if _SERVER is None:
        pytest.skip("redis-server is not installed")
    # a namespace per test: the shared server must look empty to each one
    return RemoteTier(_SERVER.url, key_prefix=f"conf{next(_namespaces)}:", capacity_bytes=16 << 10)


def _mooncake(tmp_path):
    if _POOL is None:
        pytest.skip(mooncake_unavailable() or "no Mooncake pool")
    from kvtier.tiers import MooncakeTier

    return MooncakeTier(_POOL.url, key_prefix=f"conf{next(_namespaces)}:", capacity_bytes=16 << 10)


SPECS = {
    # max_value: largest value the suite puts; fill_value: size used to fill the tier up
    "device": Spec("device", _device, 128, 100),
    "host": Spec("host", _host, 1024, 900),
    "disk": Spec("disk", _disk, 1024, 900),
    "remote": Spec("remote", _remote, 1024, 900),
    "mooncake": Spec("mooncake", _mooncake, 1024, 900),
}


@pytest.fixture(scope="session", autouse=True)
def _redis_for_conformance(tmp_path_factory):
    global _SERVER
    if REDIS_SERVER is None:
        yield
        return
    _SERVER = start_redis_server(tmp_path_factory.mktemp("redis"))
    yield
    _SERVER.kill()


def _ensure_pool(request) -> None:
    """The session's pool, started by the first test of MooncakeTier that runs (it takes seconds)."""
    global _POOL
    if _POOL is None and mooncake_unavailable() is None:
        _POOL = request.getfixturevalue("mooncake_shared")


@pytest.fixture(params=sorted(SPECS))
def spec(request):
    if request.param == "mooncake":
        _ensure_pool(request)
    return SPECS[request.param]


@pytest.fixture
def tier(spec, tmp_path):
    t = spec.make(tmp_path)
    yield t
    t.close()
