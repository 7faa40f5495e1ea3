"""One block (K and V) as one record: two codec records framed by a small header.

```
 offset 0   4 bytes  magic b"KVB1"
        4   u32 LE   length of the K record (n_k)
        8   u32 LE   length of the V record (n_v)
       12   n_k      K record  (kvtier.compress.record format)
  12 + n_k  n_v      V record
```
No pickle: both halves are parsed by ``unpack_record``, which checks its own header and CRC.
"""
from __future__ import annotations

import struct

from kvtier.compress.base import Encoded

_MAGIC = b"KVB1"
_HEADER = struct.Struct("<4sII")


def pack_block(k: Encoded, v: Encoded) -> bytes:
    """Frame the encoded K and V of one block into one record (owned bytes)."""
    from kvtier.compress.record import pack_record

    rk = pack_record(k)
    rv = pack_record(v)
    return b"".join((_HEADER.pack(_MAGIC, len(rk), len(rv)), rk, rv))


def unpack_block(buf) -> tuple[Encoded, Encoded]:
    """Inverse of :func:`pack_block`. Raises ``CorruptRecordError`` (a ``ValueError``) on bad framing."""
    from kvtier.compress.record import CorruptRecordError, unpack_record

    mv = memoryview(buf).cast("B")
    if mv.nbytes < _HEADER.size:
        raise CorruptRecordError(f"block record is {mv.nbytes} bytes, shorter than its header")
    magic, nk, nv = _HEADER.unpack_from(mv, 0)
    if magic != _MAGIC or _HEADER.size + nk + nv != mv.nbytes:
        raise CorruptRecordError(
            f"bad block record framing (magic={bytes(magic)!r}, n_k={nk}, n_v={nv}, total={mv.nbytes})")
    k = unpack_record(mv[_HEADER.size:_HEADER.size + nk])
    v = unpack_record(mv[_HEADER.size + nk:])
    return k, v
