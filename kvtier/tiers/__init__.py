"""Storage tiers: L1 device block pool, L2 DRAM ring buffer, L3 segment files on disk.

All tiers share one interface (:class:`Tier`): a bounded key -> bytes store.
"""
from .base import MAX_KEY_BYTES, BytesLike, Tier, as_byte_view, check_key
from .device import DeviceTier
from .disk import DiskTier
from .errors import DirectoryLockedError, DiskFullError, TierClosedError, TierError
from .host import HostTier

__all__ = [
    "Tier", "DeviceTier", "HostTier", "DiskTier", "TierError", "DiskFullError", "DirectoryLockedError",
    "TierClosedError", "BytesLike", "MAX_KEY_BYTES", "check_key", "as_byte_view",
]
