"""Storage tiers: L1 device block pool, L2 DRAM ring buffer, L3 segment files, L4 remote store.

All tiers share one interface (:class:`Tier`): a bounded key -> bytes store. ``RemoteTier`` is
imported on first use (it lives in :mod:`kvtier.tiers.remote`).
"""
from .base import MAX_KEY_BYTES, BytesLike, Tier, as_byte_view, check_key
from .device import DeviceTier
from .disk import DiskTier
from .errors import DirectoryLockedError, DiskFullError, TierClosedError, TierError
from .host import HostTier

__all__ = [
    "Tier", "DeviceTier", "HostTier", "DiskTier", "RemoteTier", "TierError", "DiskFullError",
    "DirectoryLockedError", "TierClosedError", "BytesLike", "MAX_KEY_BYTES", "check_key", "as_byte_view",
]


def __getattr__(name: str):
    if name == "RemoteTier":
        from .remote import RemoteTier

        return RemoteTier
    raise AttributeError(f"module 'kvtier.tiers' has no attribute {name!r}")
