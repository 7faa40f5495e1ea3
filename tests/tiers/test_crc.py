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


def test_crc32_held_equals_one_crc32_at_every_size_and_seed():
    from kvtier.tiers.disk.segment import crc32_held

    for n in (0, 1, 4095, 4096, 4097, 8192, 12_345, 65_536, 65_537, 200_000):
        data = os.urandom(n)
        for seed in (0, 0xDEADBEEF, 0xFFFFFFFF):
            assert crc32_held(data, seed) == crc32(data, seed), n
            assert crc32_held(memoryview(data), seed) == crc32(data, seed), n


def test_the_gil_holding_isal_call_is_used_where_isal_is():
    """With ISA-L, a bytes value is checked by one call of its C function that keeps the GIL
    (the values above cover it); the other implementations never take that path."""
    from kvtier.tiers.disk import segment

    assert (segment._ISAL_HELD is not None) == (IMPLEMENTATION == "isal")
