"""The record checksum is the zlib CRC-32, whichever implementation computes it."""
from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

from kvtier._crc import IMPLEMENTATION, crc32


@pytest.mark.parametrize("n", [0, 1, 7, 4096, 1 << 20])
def test_same_values_as_zlib(n):
    data = os.urandom(n)
    assert crc32(data) == zlib.crc32(data)
    assert crc32(memoryview(data)[1:]) == zlib.crc32(data[1:])
    assert crc32(np.frombuffer(data, dtype=np.uint8)) == zlib.crc32(data)
    assert crc32(data, 0xDEADBEEF) == zlib.crc32(data, 0xDEADBEEF)  # chained, as key then value
    assert IMPLEMENTATION in ("isal", "zlib")
