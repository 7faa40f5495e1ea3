"""L3, the disk tier: ``DiskTier`` (tier.py) over a directory of segment files, composed of
the parts listed in tier.py's docstring, each in its own module here."""
from .segment import REC_HEADER_BYTES, SEG_HEADER_BYTES, record_size
from .space import purge_directory
from .tier import DiskTier

__all__ = ["DiskTier", "record_size", "REC_HEADER_BYTES", "SEG_HEADER_BYTES", "purge_directory"]
