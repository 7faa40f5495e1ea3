"""DiskTier's record index (key -> location) and its checkpoint file.

The index maps key -> (segment id, offset, record size, value length) in two parts:

- ``hot``: a dict holding every key written, replaced or read since the directory was opened;
- ``base``: the checkpoint as it was loaded, kept in the arrays it was read into, so opening
  a directory of a million records creates no Python object per record (~90 bytes of RSS a
  record with 40-byte keys, against ~250 for a dict entry, its tuple and its key).

A key lives in exactly one part. ``lookup`` (under the tier lock) moves a base key it finds to
``hot``, so a key read twice costs a dict lookup from then on; replacing or removing a key
marks its base row dead.

A checkpoint writes the dict frozen rather than copied (a copy of a million entries would hold
the tier lock for ~0.1 s): ``snapshot`` sets it aside as ``frozen`` and starts an empty ``hot``,
which takes every change while the file is written (None marking a frozen key removed);
``thaw`` then folds those changes into the frozen dict a slice at a time, and it becomes
``hot`` again. Meanwhile a key is looked for in ``hot``, then ``frozen``, then ``base``.

A base lookup, with h = crc32 of the key's UTF-8 bytes and ``order`` the rows sorted by hash:
```
 bucket b = h >> shift                          (2**bits >= rows buckets, top bits of h)
 for i in start[b] .. start[b+1]:               positions in hash order with those top bits
     r = order[i]                               a row
     hash[r] == h, alive[r], keys[koff[r]:koff[r+1]] == key bytes   ->  (sid, off, size, vlen)[r]
```

The checkpoint file:
```
 INDEX = [header][segment table][hash u4 x n][sid u4 x n][offset u4 x n][size u4 x n]
         [vlen u4 x n][order u4 x n][key length u2 x n][pad to 8][keys, UTF-8, concatenated]
         [corrupt keys, UTF-8, NUL-separated]
 header = magic "KVTIDX02" | version u32 | n_segments u32 | n_keys u64 | n_corrupt u32
          | next_id u64 | watermark segment u64 | watermark offset u64 | keys bytes u64
          | corrupt bytes u64 | payload crc u32 | header crc u32
 segment table row = id u64 | size u64 | used u64 | mtime_ns u64 | tomb_bytes u64
```
The watermark is the log position (segment, offset) the index reflects: every record before
it is in the index (or was deleted/replaced before it), every record after it is replayed by
the tail scan. A file of another version is not read (the caller then scans the log, which
rebuilds everything a checkpoint holds).

Trust: the file is CRC-checked as a whole, its hash order and key lengths are checked, and a
key listed twice rejects it; a segment that existed when it was written must still have the
size and mtime it had then (unless it is the watermark segment, which grows), and no unknown
segment may sit at or before the watermark. Otherwise the caller falls back to a full scan.
Records a checkpoint indexes are not re-read at open; ``get`` verifies each record's header
and data CRC on every read, so damage after the checkpoint is still caught.
"""
from __future__ import annotations

import itertools
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvtier._crc import crc32

INDEX_NAME = "INDEX"
_MAGIC = b"KVTIDX02"
_VERSION = 2
_HDR = struct.Struct("<8sIIQIQQQQQII")
_SEGROW = np.dtype([("id", "<u8"), ("size", "<u8"), ("used", "<u8"), ("mtime_ns", "<u8"), ("tomb_bytes", "<u8")])

Loc = tuple[int, int, int, int]  # (segment id, offset, record size, value length)
_SLICE = 16384  # dict entries a checkpoint turns into columns per step


def _key_bytes(key: str) -> bytes | None:
    try:
        return key.encode("utf-8")
    except UnicodeEncodeError:  # (a lone surrogate) never a stored key
        return None


class BaseIndex:
    """The rows of a loaded checkpoint (read-only arrays) and which of them are still alive."""

    def __init__(self, hashes: np.ndarray, cols: np.ndarray, order: np.ndarray, klen: np.ndarray,
                 keys: memoryview) -> None:
        n = len(hashes)
        self.n = n
        self.hashes, self.cols, self.order, self.keys = hashes, cols, order, keys  # cols: [4, n]
        self.koff = np.zeros(n + 1, dtype=np.uint64)
        np.cumsum(klen, out=self.koff[1:])
        bits = max(1, n.bit_length())
        self.shift = 32 - bits
        hs = hashes[order]
        start = np.zeros((1 << bits) + 1, dtype=np.uint32)
        np.cumsum(np.bincount(hs >> self.shift, minlength=1 << bits), out=start[1:])
        self.alive = bytearray(b"\x01") * n
        self.alive_n = n
        # memoryviews: indexing one gives a Python int at a fraction of a numpy scalar's cost
        self._hs, self._start, self._order, self._koff = (memoryview(hs), memoryview(start), memoryview(order),
                                                          memoryview(self.koff))
        self._sid, self._off, self._size, self._vlen = (memoryview(c) for c in cols)

    def sorted_hashes(self) -> np.ndarray:
        return np.asarray(self._hs)

    def find(self, kb: bytes) -> int:
        """The alive row holding key bytes ``kb``, or -1."""
        h = crc32(kb)
        b = h >> self.shift
        hs, order, koff, keys, alive = self._hs, self._order, self._koff, self.keys, self.alive
        for i in range(self._start[b], self._start[b + 1]):
            if hs[i] == h:
                r = order[i]
                if alive[r] and keys[koff[r]:koff[r + 1]] == kb:
                    return r
        return -1

    def loc(self, r: int) -> Loc:
        return self._sid[r], self._off[r], self._size[r], self._vlen[r]

    def key(self, r: int) -> str:
        return bytes(self.keys[self._koff[r]:self._koff[r + 1]]).decode("utf-8")

    def kill(self, r: int) -> None:
        self.alive[r] = 0
        self.alive_n -= 1

    def alive_rows(self) -> np.ndarray:
        return np.flatnonzero(np.frombuffer(self.alive, dtype=np.uint8))

    def drop_segments(self, sids: set[int]) -> None:
        """Mark dead every row in one of the segments ``sids``."""
        alive = np.frombuffer(self.alive, dtype=np.uint8)
        alive[np.isin(self.cols[0], np.fromiter(sids, dtype=np.uint32, count=len(sids)))] = 0
        self.alive_n = int(np.count_nonzero(alive))

    def live_bytes(self) -> dict[int, int]:
        """segment id -> bytes of the alive rows' records there."""
        rows = self.alive_rows()
        per = np.bincount(self.cols[0][rows], weights=self.cols[2][rows].astype(np.float64))
        return {int(s): int(per[s]) for s in np.flatnonzero(per)}


class RecordIndex:
    """key -> (segment id, offset, record size, value length): a dict over a checkpoint's arrays.

    Mutations (``lookup``, ``replace``, ``pop``, ``clear``, ``snapshot``, ``thaw``) run under
    the tier lock. ``get`` and ``in`` may run without it: they look in the dict, the frozen
    dict and the base, then in the dict again; every move between them (a base key into the
    dict, a change folded into the frozen dict, the frozen dict becoming the dict) puts a key
    on its new side before it leaves the old one, so it is found on one side or the other.
    """

    def __init__(self, base: BaseIndex | None = None) -> None:
        self._hot: dict[str, Loc | None] = {}  # None (only while frozen): a frozen key removed
        self._frozen: dict[str, Loc] | None = None  # the dict a checkpoint is writing
        self._base = base if base is not None and base.alive_n else None
        self._len = self._base.alive_n if self._base is not None else 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def __getitem__(self, key: str) -> Loc:
        loc = self.get(key)
        if loc is None:
            raise KeyError(key)
        return loc

    def get(self, key: str, default=None):
        loc = self._hot.get(key)
        if loc is None:
            loc = self._below(key)[0]
            if loc is None:
                loc = self._hot.get(key)  # moved meanwhile: out of the base, or the frozen dict thawed
        return default if loc is None else loc

    def _below(self, key: str) -> tuple[Loc | None, int]:
        """Where ``key`` is, for a caller that found no location for it in the dict: (its frozen
        location, -1) unless removed since, else (its base row's location, the row), else
        (None, -1). Safe without the tier lock (``get``): it reads the frozen dict and the base
        once each, and a key moving between them meanwhile is found by the caller's second
        look in the dict."""
        frozen = self._frozen
        if frozen is not None:
            if key in self._hot:
                return None, -1  # removed since the freeze
            loc = frozen.get(key)
            if loc is not None:
                return loc, -1
        base = self._base
        if base is not None:
            kb = _key_bytes(key)
            r = base.find(kb) if kb is not None else -1
            if r >= 0:
                return base.loc(r), r
        return None, -1

    def lookup(self, key: str) -> Loc | None:
        """``get``, moving a key found in the base to the dict (caller holds the tier lock)."""
        hot = self._hot
        loc = hot.get(key)
        if loc is None:
            loc, r = self._below(key)
            if r >= 0:
                hot[key] = loc  # in the dict before it leaves the base
                self._kill(r)
        return loc

    def lookup_many(self, keys: list[str]) -> list[Loc | None]:
        """``lookup`` of each key (caller holds the tier lock)."""
        if self._base is None and self._frozen is None:
            get = self._hot.get
            return [get(k) for k in keys]
        return [self.lookup(k) for k in keys]

    def replace(self, key: str, loc: Loc) -> Loc | None:
        """Map ``key`` to ``loc``; returns the location it had, or None."""
        hot = self._hot
        old, r = hot.get(key), -1
        if old is None:
            old, r = self._below(key)
        hot[key] = loc
        if r >= 0:
            self._kill(r)
        if old is None:
            self._len += 1
        return old

    def pop(self, key: str, default=None):
        hot = self._hot
        loc, r = hot.get(key), -1
        if loc is None:
            loc, r = self._below(key)
            if loc is None:
                return default
        if self._frozen is not None and key in self._frozen:
            hot[key] = None  # hides the frozen location until thawed
        else:
            hot.pop(key, None)
        if r >= 0:
            self._kill(r)
        self._len -= 1
        return loc

    def _kill(self, r: int) -> None:
        self._base.kill(r)
        if not self._base.alive_n:
            self._base = None  # its memory goes back

    def clear(self) -> None:
        self._hot = {}
        self._frozen = None  # a checkpoint writing it keeps its own reference
        self._base = None
        self._len = 0

    def drop_segments(self, sids: set[int]) -> None:
        """Forget every key located in one of the segments ``sids`` (at open: files gone since
        the checkpoint; the dict is still empty then)."""
        assert not self._hot and self._frozen is None, "drop_segments runs on a freshly loaded index"
        if self._base is not None and sids:
            self._base.drop_segments(sids)
            if not self._base.alive_n:
                self._base = None
            self._len = self._base.alive_n if self._base is not None else 0

    def live_bytes(self) -> dict[int, int]:
        """segment id -> bytes of the records the index points to there."""
        live = self._base.live_bytes() if self._base is not None else {}
        for _, (sid, _, size, _) in self._dict_items():
            live[sid] = live.get(sid, 0) + size
        return live

    def _dict_items(self) -> Iterator[tuple[str, Loc]]:
        hot, frozen = self._hot, self._frozen
        for key, loc in hot.items():
            if loc is not None:
                yield key, loc
        if frozen is not None:
            for key, loc in frozen.items():
                if key not in hot:
                    yield key, loc

    def __iter__(self) -> Iterator[str]:
        for key, _ in self._dict_items():
            yield key
        base = self._base
        if base is not None:
            for r in base.alive_rows().tolist():
                yield base.key(r)

    def items(self) -> Iterator[tuple[str, Loc]]:
        yield from self._dict_items()
        base = self._base
        if base is not None:
            for r in base.alive_rows().tolist():
                yield base.key(r), base.loc(r)

    def snapshot(self) -> IndexSnapshot:
        """The index as it is now, for ``save`` to write outside the tier lock, without a copy
        of the dict: it is frozen until ``thaw`` gives it back (the base's arrays are never
        written to, so of the base only which rows are alive is copied)."""
        if self._frozen is not None:  # an earlier thaw cut short by an exception
            self._fold(len(self._hot))
        frozen = self._hot
        self._frozen = frozen  # before the dict is replaced: a reader without the lock finds every key
        self._hot = {}
        base = self._base
        return IndexSnapshot(frozen, base, bytes(base.alive) if base is not None else b"")

    def thaw(self, snap: IndexSnapshot, budget: int = 4096) -> bool:
        """Fold up to ``budget`` of the changes made since ``snap`` into its dict (caller holds
        the tier lock, and lets it go between calls); True once none is left and that dict is
        the index's own again, or when the index was cleared meanwhile."""
        if self._frozen is not snap.hot:
            return True
        return self._fold(budget)

    def _fold(self, budget: int) -> bool:
        hot, frozen = self._hot, self._frozen
        for key in list(itertools.islice(hot, budget)):
            loc = hot[key]
            if loc is None:
                del frozen[key]
            else:
                frozen[key] = loc
            del hot[key]  # after: a reader without the lock finds it on one side
        if hot:
            return False
        self._hot = frozen
        self._frozen = None
        return True


@dataclass
class IndexSnapshot:
    """What ``save`` writes: ``hot`` (frozen while it is written), ``base``, whose rows
    ``alive`` marks alive."""

    hot: dict
    base: BaseIndex | None
    alive: bytes


@dataclass
class SegmentRow:
    id: int
    size: int
    used: int
    mtime_ns: int
    tomb_bytes: int


@dataclass
class Checkpoint:
    """An index as of a log position: ``index`` a RecordIndex when loaded, an IndexSnapshot when
    being saved; ``live``: segment id -> bytes of the records the index points to there."""

    index: RecordIndex | IndexSnapshot
    live: dict
    segments: list[SegmentRow]
    corrupt: list[str]
    next_id: int
    watermark: tuple[int, int]  # (segment id, offset)


def _columns(snap: IndexSnapshot) -> tuple[np.ndarray, np.ndarray, np.ndarray, list]:
    """(hashes [n], cols [4, n], key lengths [n], key byte parts) of every key in ``snap``:
    the base's alive rows (taken as arrays), then the dict's, ``_SLICE`` entries at a time
    (each slice's loops run in C, holding the GIL: a million entries at once would hold it ~0.5 s)."""
    hashes, cols, klen, parts = [], [], [], []
    base = snap.base
    if base is not None:
        alive = np.frombuffer(snap.alive, dtype=np.uint8)
        rows = np.flatnonzero(alive)
        if len(rows):
            hashes.append(base.hashes[rows])
            cols.append(base.cols[:, rows])
            lens = np.diff(base.koff).astype(np.uint16)
            klen.append(lens[rows])
            if len(rows) == base.n:
                parts.append(base.keys)
            else:  # the alive rows' key bytes, gathered with a byte mask
                parts.append(np.frombuffer(base.keys, dtype=np.uint8)[np.repeat(alive.astype(bool), lens)].tobytes())
    # keys and values side by side: (key, value) pairs would be new objects for the cyclic GC
    # to count, and a million of them set off a full collection (~0.5 s holding the GIL)
    keys, locs = iter(snap.hot), iter(snap.hot.values())  # (the dict is frozen: changed, these raise)
    while chunk := list(itertools.islice(keys, _SLICE)):
        m = len(chunk)
        kbs = [k.encode("utf-8") for k in chunk]
        hashes.append(np.fromiter(map(crc32, kbs), dtype=np.uint32, count=m))
        flat = np.fromiter(itertools.chain.from_iterable(itertools.islice(locs, m)), dtype=np.uint64, count=4 * m)
        assert int(flat.max()) < 1 << 32, "segment ids, offsets and sizes fit u32"
        cols.append(flat.reshape(m, 4).T.astype(np.uint32))
        klen.append(np.fromiter(map(len, kbs), dtype=np.uint16, count=m))
        parts.append(b"".join(kbs))
    if not hashes:
        return (np.zeros(0, np.uint32), np.zeros((4, 0), np.uint32), np.zeros(0, np.uint16), [])
    return np.concatenate(hashes), np.concatenate(cols, axis=1), np.concatenate(klen), parts


def save(dirpath: str, cp: Checkpoint) -> int:
    """Write ``cp`` (its index an IndexSnapshot) atomically (temp file + rename); returns the
    bytes written.

    Not fsynced: after a power loss a missing or partial INDEX fails its CRC (a full scan
    follows) and an older one is still right, as the log it describes only grew since."""
    snap = cp.index
    assert isinstance(snap, IndexSnapshot), "save writes a snapshot"
    hashes, cols, klen, parts = _columns(snap)
    n = len(hashes)
    order = np.argsort(hashes, kind="stable").astype("<u4")  # (numpy lets go of the GIL here)
    kbytes = sum(map(len, parts))
    corrupt = "\0".join(cp.corrupt).encode("utf-8")
    segs = np.array([(s.id, s.size, s.used, s.mtime_ns, s.tomb_bytes) for s in cp.segments], dtype=_SEGROW)
    fixed = [hashes.astype("<u4"), cols.astype("<u4"), order, klen.astype("<u2")]
    pad = b"\0" * (-26 * n % 8)
    payload = [segs.tobytes(), *(a.tobytes() for a in fixed), pad, *parts, corrupt]  # keys: written in parts
    pcrc = 0
    for p in payload:
        pcrc = crc32(p, pcrc)
    head = _HDR.pack(_MAGIC, _VERSION, len(segs), n, len(cp.corrupt), cp.next_id, cp.watermark[0],
                     cp.watermark[1], kbytes, len(corrupt), pcrc, 0)
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
    if magic != _MAGIC or version != _VERSION or crc32(raw[:_HDR.size - 4]) != hcrc:
        return None
    seg_bytes = nseg * _SEGROW.itemsize
    fixed = 26 * n + (-26 * n % 8)
    if len(raw) != _HDR.size + seg_bytes + fixed + kbytes + cbytes:
        return None
    body = memoryview(raw)[_HDR.size:]
    if crc32(body) != pcrc:
        return None
    segs = np.frombuffer(body, dtype=_SEGROW, count=nseg)
    at = seg_bytes
    u4 = np.frombuffer(body, dtype="<u4", count=6 * n, offset=at).reshape(6, n).astype(np.uint32, copy=False)
    hashes, cols, order = u4[0], u4[1:5], u4[5]
    klen = np.frombuffer(body, dtype="<u2", count=n, offset=at + 24 * n)
    at += fixed
    keys = body[at:at + kbytes]
    try:
        corrupt = bytes(body[at + kbytes:]).decode("utf-8").split("\0") if ncor else []
    except UnicodeDecodeError:
        return None
    if len(corrupt) != ncor or not _consistent(hashes, order, klen, kbytes):
        return None
    base = BaseIndex(hashes, cols, order, klen, keys) if n else None
    if base is not None and _duplicate_key(base):
        return None
    rows = [SegmentRow(*map(int, r)) for r in segs.tolist()]
    index = RecordIndex(base)
    return Checkpoint(index, index.live_bytes(), rows, corrupt, int(next_id), (int(wsid), int(woff)))


def _consistent(hashes: np.ndarray, order: np.ndarray, klen: np.ndarray, kbytes: int) -> bool:
    """Whether ``order`` is a permutation sorting ``hashes`` and the key lengths add up."""
    n = len(hashes)
    if n == 0:
        return kbytes == 0
    if int(order.max()) >= n or int(klen.min()) == 0 or int(klen.sum(dtype=np.uint64)) != kbytes:
        return False
    seen = np.zeros(n, dtype=bool)
    seen[order] = True
    if not seen.all():
        return False
    hs = hashes[order]
    return bool(np.all(hs[1:] >= hs[:-1]))


def _duplicate_key(base: BaseIndex) -> bool:
    """Whether a key is listed twice (not a file this module wrote): only rows whose hashes
    collide are compared."""
    hs = base.sorted_hashes()
    for i in np.flatnonzero(hs[1:] == hs[:-1]).tolist():
        j = i + 1
        same = [int(base.order[i])]
        while j < base.n and hs[j] == hs[i]:
            same.append(int(base.order[j]))
            j += 1
        if len({bytes(base.keys[base.koff[r]:base.koff[r + 1]]) for r in same}) < len(same):
            return True
    return False


def remove(dirpath: str) -> None:
    for name in (INDEX_NAME, INDEX_NAME + ".tmp"):
        try:
            os.unlink(os.path.join(dirpath, name))
        except FileNotFoundError:
            pass
