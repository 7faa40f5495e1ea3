"""Fixtures shared by every test package: a real redis-server on a loopback port
(:mod:`tests.redis_server`) and a real Mooncake Store pool (:mod:`tests.mooncake_server`).

Each test that asks for ``redis_server`` gets its own server process (startup takes a few
milliseconds), so tests that kill and restart it cannot disturb others.
"""
from __future__ import annotations

import pytest

from tests.mooncake_server import MooncakePool, mooncake_unavailable, start_mooncake_pool
from tests.redis_server import REDIS_SERVER, RedisServer, start_redis_server


def require_redis() -> None:
    """Skip the calling test when no redis-server is installed."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (Debian package redis-server; `make system-deps` installs it)")


def serve_redis(tmp_path_factory):
    """The body of a one-server fixture, whatever its scope: ``yield from serve_redis(...)``
    starts a fresh server (or skips) and kills it when the fixture is torn down."""
    require_redis()
    server = start_redis_server(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def redis_server(tmp_path_factory):
    """A fresh redis-server for this test (:class:`RedisServer`: ``.url``, ``.kill()``, ``.restart()``)."""
    yield from serve_redis(tmp_path_factory)


@pytest.fixture
def redis_server_factory(tmp_path_factory):
    """Start extra servers with their own options: ``redis_server_factory("--maxmemory", "2mb")``."""
    require_redis()
    started: list[RedisServer] = []

    def make(*extra_args: str) -> RedisServer:
        server = start_redis_server(tmp_path_factory.mktemp("redis"), extra_args=extra_args)
        started.append(server)
        return server

    try:
        yield make
    finally:
        for server in started:
            server.kill()


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of a fresh redis-server for this test, e.g. ``redis://127.0.0.1:40123/0``."""
    return redis_server.url


def require_mooncake() -> None:
    """Skip the calling test when the Mooncake wheel cannot load (or its binaries are missing)."""
    why = mooncake_unavailable()
    if why is not None:
        pytest.skip(why)


def serve_mooncake(tmp_path_factory, **kw):
    """The body of a one-pool fixture: ``yield from serve_mooncake(...)`` starts a master and a
    store server (or skips) and kills both when the fixture is torn down."""
    require_mooncake()
    pool = start_mooncake_pool(tmp_path_factory.mktemp("mooncake"), **kw)
    try:
        yield pool
    finally:
        pool.kill()


@pytest.fixture(scope="session")
def mooncake_shared(tmp_path_factory) -> MooncakePool:
    """One pool for the session, for tests that leave the master alone (give each its own
    ``key_prefix``)."""
    yield from serve_mooncake(tmp_path_factory)


@pytest.fixture
def mooncake_pool(tmp_path_factory) -> MooncakePool:
    """A fresh pool for this test (:class:`MooncakePool`: ``.url``, ``.kill_master()``,
    ``.restart_master()``)."""
    yield from serve_mooncake(tmp_path_factory)
