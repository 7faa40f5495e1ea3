"""Errors raised by tiers.

Capacity exhausted is *not* an error (``put`` returns False); bad arguments raise ``ValueError``.
These classes cover the environment failing under a tier: a full disk, a directory that another
writer holds, a closed tier being used.
"""
from __future__ import annotations


class TierError(Exception):
    """Base class for tier failures that are neither bad input nor a full tier."""


class DiskFullError(TierError, OSError):
    """The filesystem under a DiskTier ran out of space (ENOSPC/EDQUOT/EFBIG).

    Every record written before the failing call stays readable; the failing batch is not indexed.
    """


class DirectoryLockedError(TierError):
    """Another DiskTier (in this or another process) holds the directory's lock file."""


class TierClosedError(TierError):
    """The tier was used after ``close()``."""
