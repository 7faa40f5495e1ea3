"""Fixtures shared by every test package: a real redis-server on a loopback port
(:mod:`tests.redis_server`).

Each test that asks for ``redis_server`` gets its own server process (startup takes a few
milliseconds), so tests that kill and restart it cannot disturb others.
"""
from __future__ import annotations

import pytest

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
