"""CRC-32 (the zlib/IEEE polynomial) for record checksums.

ISA-L's implementation (package ``isal``) computes the same values several times faster than
zlib's (about 8 vs 2-4 GB/s here), which decides DiskTier's read bandwidth and part of every
record's parse time; it is used when installed, zlib otherwise. Both release the GIL on large
buffers.
"""
from __future__ import annotations

try:
    from isal.isal_zlib import crc32
    IMPLEMENTATION = "isal"
except ImportError:  # optional accelerator: zlib gives identical values
    from zlib import crc32
    IMPLEMENTATION = "zlib"

__all__ = ["crc32", "IMPLEMENTATION", "c_address"]


def c_address() -> int | None:
    """The address of the C function behind :func:`crc32` when it is ISA-L's
    (``crc32_gzip_refl(seed, buf, len)``, the same values), for compiled code to call; None
    with zlib or where it cannot be found."""
    if IMPLEMENTATION != "isal":
        return None
    import ctypes

    from isal import isal_zlib

    try:
        fn = ctypes.CDLL(isal_zlib.__file__).crc32_gzip_refl
    except (OSError, AttributeError):
        return None
    return ctypes.cast(fn, ctypes.c_void_p).value
