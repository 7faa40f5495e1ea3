"""Storage tiers: L1 device block pool, L2 DRAM ring buffer, L3 segment files, L4 remote store.

All tiers share one interface (:class:`Tier`): a bounded key -> bytes store. The L4 tiers are
imported on first use: ``RemoteTier`` (Redis/Valkey, :mod:`kvtier.tiers.remote`) and
``MooncakeTier`` (Mooncake Store, :mod:`kvtier.tiers.mooncake`); ``open_remote`` picks one by URL.
"""
from .base import MAX_KEY_BYTES, BytesLike, Tier, as_byte_view, check_key
from .device import DeviceTier
from .disk import DiskTier
from .errors import DirectoryLockedError, DiskFullError, TierClosedError, TierError
from .host import HostTier

__all__ = [
    "Tier", "DeviceTier", "HostTier", "DiskTier", "RemoteTier", "MooncakeTier", "open_remote", "TierError",
    "DiskFullError", "DirectoryLockedError", "TierClosedError", "BytesLike", "MAX_KEY_BYTES", "check_key", "as_byte_view",
]


def __getattr__(name: str):
    if name == "RemoteTier":
        from .remote import RemoteTier

        return RemoteTier
    if name == "MooncakeTier":
        from .mooncake import MooncakeTier

        return MooncakeTier
    if name == "open_remote":
        from .remotes import open_remote

        return open_remote
    raise AttributeError(f"module 'kvtier.tiers' has no attribute {name!r}")
