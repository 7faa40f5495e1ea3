"""Which L4 a ``remote_url`` names: ``redis://``, ``rediss://`` and ``unix://`` a Redis/Valkey
server (:class:`~kvtier.tiers.remote.RemoteTier`), ``mooncake://`` a Mooncake Store pool
(:class:`~kvtier.tiers.mooncake.MooncakeTier`). The one place both the transformers store and the
vLLM connector open their L4 from."""
from __future__ import annotations

from urllib.parse import urlsplit

from .base import Tier

MOONCAKE_SCHEME = "mooncake"


def is_mooncake(url: str) -> bool:
    try:
        return urlsplit(url).scheme == MOONCAKE_SCHEME
    except ValueError:
        return False


def open_remote(url: str, *, key_prefix: str, redis_timeout_s: float | None = None) -> Tier:
    """The L4 tier ``url`` names, under ``key_prefix``. Nothing is contacted yet: an unreachable
    server or master is a miss on first use.

    Args:
        redis_timeout_s: bound on one Redis round trip (RemoteTier's default when None); a
            Mooncake master is probed with bounds of its own instead.
    """
    if is_mooncake(url):
        from .mooncake import MooncakeTier

        return MooncakeTier(url, key_prefix=key_prefix)
    from .remote import RemoteTier

    kw = {} if redis_timeout_s is None else {"socket_timeout_s": redis_timeout_s}
    return RemoteTier(url, key_prefix=key_prefix, **kw)
