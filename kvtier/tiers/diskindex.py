"""DiskTier's index checkpoint: the whole key -> location index in one file, so reopening a
directory reads that file and scans only the log written after it.

```
 INDEX = [header][segment table][sid u32 x n][offset u32 x n][size u32 x n][vlen u32 x n]
         [keys, UTF-8, NUL-separated][corrupt keys, UTF-8, NUL-separated]
 header = magic "KVTIDX01" | version u32 | n_segments u32 | n_keys u64 | n_corrupt u32
          | next_id u64 | watermark segment u64 | watermark offset u64 | keys bytes u64
          | corrupt bytes u64 | payload crc u32 | header crc u32
 segment table row = id u64 | size u64 | used u64 | mtime_ns u64 | tomb_bytes u64
```
The watermark is the log position (segment, offset) the index reflects: every record before
it is in the index (or was deleted/replaced before it), every record after it is replayed by
the tail scan. Keys cannot hold NUL (``check_key``), so the key blob splits unambiguously.

Trust: the file is CRC-checked as a whole; a segment that existed when it was written must
still have the size and mtime it had then (unless it is the watermark segment, which grows),
and no unknown segment may sit at or before the watermark. Otherwise the caller falls back to
a full scan. Records a checkpoint indexes are not re-read at open; ``get`` verifies each
record's header and data CRC on every read, so damage after the checkpoint is still caught.
"""
from __future__ import annotations

import gc
import itertools
import os
import struct
from dataclasses import dataclass

import numpy as np

from kvtier._crc import crc32

INDEX_NAME = "INDEX"
_MAGIC = b"KVTIDX01"
_HDR = struct.Struct("<8sIIQIQQQQQII")
_SEGROW = np.dtype([("id", "<u8"), ("size", "<u8"), ("used", "<u8"), ("mtime_ns", "<u8"), ("tomb_bytes", "<u8")])


@dataclass
class SegmentRow:
    id: int
    size: int
    used: int
    mtime_ns: int
    tomb_bytes: int


@dataclass
class Checkpoint:
    """An index snapshot: ``index`` maps key -> (segment id, offset, record size, value length)."""

    index: dict
    live: dict  # segment id -> bytes of the records the index points to there
    segments: list[SegmentRow]
    corrupt: list[str]
    next_id: int
    watermark: tuple[int, int]  # (segment id, offset)


def save(dirpath: str, cp: Checkpoint) -> int:
    """Write ``cp`` atomically (temp file + rename); returns the bytes written.

    Not fsynced: after a power loss a missing or partial INDEX fails its CRC (a full scan
    follows) and an older one is still right, as the log it describes only grew since."""
    n = len(cp.index)
    if n:
        flat = np.fromiter(itertools.chain.from_iterable(cp.index.values()), dtype=np.uint64, count=4 * n)
        assert int(flat.max()) < 1 << 32, "segment ids, offsets and sizes fit u32"
        cols = np.ascontiguousarray(flat.reshape(n, 4).T.astype("<u4"))  # [4, n]: sid, offset, size, vlen
    else:
        cols = np.zeros((4, 0), dtype="<u4")
    keys = "\0".join(cp.index).encode("utf-8")
    corrupt = "\0".join(cp.corrupt).encode("utf-8")
    segs = np.array([(s.id, s.size, s.used, s.mtime_ns, s.tomb_bytes) for s in cp.segments], dtype=_SEGROW)
    payload = [segs.tobytes(), cols.tobytes(), keys, corrupt]
    pcrc = 0
    for p in payload:
        pcrc = crc32(p, pcrc)
    head = _HDR.pack(_MAGIC, 1, len(segs), n, len(cp.corrupt), cp.next_id, cp.watermark[0], cp.watermark[1],
                     len(keys), len(corrupt), pcrc, 0)
    head = head[:-4] + struct.pack("<I", crc32(head[:-4]))
    final = os.path.join(dirpath, INDEX_NAME)
    tmp = final + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        for part in [head, *payload]:
            view = memoryview(part)
            while view.nbytes:
                view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.replace(tmp, final)
    return len(head) + sum(len(p) for p in payload)


def load(dirpath: str) -> Checkpoint | None:
    """The checkpoint in ``dirpath``, or None when there is none or it does not check out."""
    try:
        with open(os.path.join(dirpath, INDEX_NAME), "rb") as f:
            raw = f.read()
    except OSError:
        return None
    if len(raw) < _HDR.size:
        return None
    (magic, version, nseg, n, ncor, next_id, wsid, woff, kbytes, cbytes, pcrc, hcrc) = _HDR.unpack_from(raw)
    if magic != _MAGIC or version != 1 or crc32(raw[:_HDR.size - 4]) != hcrc:
        return None
    seg_bytes = nseg * _SEGROW.itemsize
    if len(raw) != _HDR.size + seg_bytes + 16 * n + kbytes + cbytes:
        return None
    body = memoryview(raw)[_HDR.size:]
    if crc32(body) != pcrc:
        return None
    segs = np.frombuffer(body[:seg_bytes], dtype=_SEGROW)
    cols = np.frombuffer(body[seg_bytes:seg_bytes + 16 * n], dtype="<u4").reshape(4, n)
    at = seg_bytes + 16 * n
    try:
        keys = bytes(body[at:at + kbytes]).decode("utf-8").split("\0") if n else []
        corrupt = bytes(body[at + kbytes:]).decode("utf-8").split("\0") if ncor else []
    except UnicodeDecodeError:
        return None
    if len(keys) != n or len(corrupt) != ncor:
        return None
    paused = gc.isenabled()
    gc.disable()  # a million new tuples would trigger collections that traverse all of them
    try:
        index = dict(zip(keys, zip(*(c.tolist() for c in cols)))) if n else {}
    finally:
        if paused:
            gc.enable()
    if len(index) != n:  # a key listed twice: not a file this module wrote
        return None
    live = {}
    if n:
        per = np.bincount(cols[0], weights=cols[2].astype(np.float64))
        live = {int(s): int(per[s]) for s in np.flatnonzero(per)}
    rows = [SegmentRow(*map(int, r)) for r in segs.tolist()]
    return Checkpoint(index, live, rows, corrupt, int(next_id), (int(wsid), int(woff)))


def remove(dirpath: str) -> None:
    for name in (INDEX_NAME, INDEX_NAME + ".tmp"):
        try:
            os.unlink(os.path.join(dirpath, name))
        except FileNotFoundError:
            pass
