"""L2: one preallocated byte arena used as a ring buffer (a circular log of records).

```
 arena [0, capacity)                                    log (deque, oldest first)
 +--------+------+--------+-----------+------+----+     [off, size, key]   key None = hole
 | hole   | rec  | rec    |  free     | rec  |pad |
 +--------+------+--------+-----------+------+----+
          ^tail           ^head       ^ (wrapped: tail > head)
```
A record is ``header | key | value`` padded to 64 bytes, header = magic, key length, value
length, CRC32 of key+value (only computed with ``checksum=True``: DRAM is not a crash domain
and the disk tier checksums what it stores). ``put`` appends at the head. ``delete`` turns a
record into a hole; holes at the tail are reclaimed at once. When the head would overrun live
records at the tail, those records are handed to ``spill`` in batches of about
``spill_batch_bytes`` (oldest first) and only then is their space reused. Without ``spill``, or
when it raises, ``put`` returns False and every live record stays: nothing is dropped silently.
Without ``spill``, holes pinned behind a live tail record are reclaimed by moving the live
records to the start of the arena (``defragments`` in stats), so ``put`` only fails when the
live records plus the new one exceed the arena.

Overflow: when ``spill`` fails (the next tier refuses: a full disk) and ``overflow_bytes`` > 0,
``put`` keeps the record as an owned copy outside the arena instead of refusing it, up to
``overflow_bytes`` of records (counted like the arena's); only past that does it return False.
Once a spill succeeds again, the overflow is handed to ``spill`` too (oldest first), so the
tier shrinks back to its arena. ``stats()`` shows it (``overflow_*``).

Ownership: ``put`` copies; ``get`` returns an owned ``bytes``; ``get_into`` copies into the
caller's buffer; ``spill`` receives read-only views into the arena that are valid only during
the call (it must copy what it keeps).
"""
from __future__ import annotations

import logging
import struct
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from kvtier._crc import crc32
from .base import BytesLike, Tier, TierStats, as_byte_view, check_key, out_view
from .errors import TierClosedError

log = logging.getLogger(__name__)

SpillFn = Callable[[list[tuple[str, memoryview]]], None]

_MAGIC = 0x4B56524C  # "KVRL"
_HDR = struct.Struct("<IHHII")  # magic, key_len, flags, value_len, crc32(key+value)
_ALIGN = 64
_TORCH_COPY_MIN = 256 << 10  # above this, torch's (multi-threaded) copy beats a memoryview copy


def _align(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


class HostTier(Tier):
    """DRAM ring buffer of encoded records.

    Args:
        capacity_bytes: arena size (headers and padding included), >= 4096.
        spill: called with the oldest live records before their space is reused, or None.
        pin_memory: pin the arena for async device copies; None = pin when CUDA is available.
        spill_batch_bytes: value bytes per spill call (at least one record); None = min(4 MiB,
            capacity/8).
        checksum: compute and keep a CRC32 of key+value in each record header, verified on get.
        overflow_bytes: records kept beyond the arena while ``spill`` fails (0 = refuse them).
    """

    name = "host"

    def __init__(self, capacity_bytes: int, spill: SpillFn | None = None, pin_memory: bool | None = None,
                 spill_batch_bytes: int | None = None, checksum: bool = False, overflow_bytes: int = 0) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes < 4096:
            raise ValueError(f"capacity_bytes must be an int >= 4096, got {capacity_bytes!r}")
        if spill is not None and not callable(spill):
            raise ValueError(f"spill must be a callable or None, got {type(spill).__name__}")
        if pin_memory not in (None, True, False):
            raise ValueError(f"pin_memory must be True, False or None, got {pin_memory!r}")
        if spill_batch_bytes is None:
            spill_batch_bytes = max(1, min(4 << 20, capacity_bytes // 8))
        if not isinstance(spill_batch_bytes, int) or spill_batch_bytes < 1:
            raise ValueError(f"spill_batch_bytes must be an int >= 1, got {spill_batch_bytes!r}")
        if not isinstance(overflow_bytes, int) or overflow_bytes < 0:
            raise ValueError(f"overflow_bytes must be an int >= 0, got {overflow_bytes!r}")
        cap = capacity_bytes & ~(_ALIGN - 1)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self._cap = cap
        self.spill = spill
        self.spill_batch_bytes = spill_batch_bytes
        self.checksum = bool(checksum)
        self.pinned = bool(pin_memory)
        self.arena = torch.empty(cap, dtype=torch.uint8, pin_memory=self.pinned)  # [capacity] bytes
        self._np = self.arena.numpy()
        self._mv = memoryview(self._np)
        self._log: deque[list] = deque()  # [offset, size, key|None], oldest first
        self._index: dict[str, list] = {}  # key -> its log entry
        self._vlen: dict[str, int] = {}
        self._live = 0  # bytes of live records (header + padding included)
        self._lock = threading.RLock()
        self._stats = TierStats()
        self._spills = self._spilled_records = self._spilled_bytes = self._spill_errors = 0
        self.last_spill_error: BaseException | None = None
        self._defrags = 0
        self._closed = False
        self.overflow_bytes = overflow_bytes
        self._over: dict[str, bytes] = {}  # key -> value kept outside the arena, oldest first
        self._over_used = 0  # record_bytes of those
        self._over_puts = self._over_peak = 0

    # -- capacity ---------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._cap

    @property
    def used_bytes(self) -> int:
        """Bytes held by live records, headers and padding included (overflow too)."""
        return self._live + self._over_used

    @staticmethod
    def record_bytes(key: str, value_bytes: int) -> int:
        """Arena bytes one record takes (what ``used_bytes`` grows by); the same for every ring."""
        return _align(_HDR.size + len(key.encode("utf-8")) + value_bytes)

    # -- ring arithmetic --------------------------------------------------------------------
    def _head_tail(self) -> tuple[int, int]:
        last = self._log[-1]
        return last[0] + last[1], self._log[0][0]

    def _place(self, size: int) -> int | None:
        """Offset where ``size`` contiguous bytes fit at the head, or None. May append a pad hole."""
        if not self._log:
            return 0
        head, tail = self._head_tail()
        if tail < head:  # not wrapped: free space is [head, cap) and [0, tail)
            if size <= self._cap - head:
                return head
            if size <= tail:
                if head < self._cap:
                    self._log.append([head, self._cap - head, None])  # pad to the end
                return 0
            return None
        # wrapped (or exactly full): free space is [head, tail)
        return head if size <= tail - head else None

    def _drop_tail_holes(self) -> None:
        while self._log and self._log[0][2] is None:
            self._log.popleft()

    def _spill_batch(self) -> bool:
        """Hand the oldest live records to ``spill``; True when their space is now free."""
        batch, entries, nbytes = [], [], 0
        for ent in self._log:
            if nbytes >= self.spill_batch_bytes:
                break
            key = ent[2]
            if key is None:
                continue
            off = ent[0] + _HDR.size + len(key.encode("utf-8"))
            n = self._vlen[key]
            batch.append((key, self._mv[off:off + n].toreadonly()))
            entries.append(ent)
            nbytes += n
        assert batch, "spill requested with no live record in the log"
        try:
            self.spill(batch)
        except Exception as exc:  # the caller decides; we keep every record and report
            self._spill_errors += 1
            self.last_spill_error = exc
            log.warning("HostTier spill failed, keeping %d records: %r", len(batch), exc)
            return False
        finally:
            for _, mv in batch:
                mv.release()
        for ent in entries:
            key = ent[2]
            if key is not None and self._index.get(key) is ent:  # spill may have deleted it
                del self._index[key], self._vlen[key]
                self._live -= ent[1]
            ent[2] = None
        self._spills += 1
        self._spilled_records += len(entries)
        self._spilled_bytes += nbytes
        self._drop_tail_holes()
        return True

    def _defragment(self) -> None:
        """Move every live record, in log order, to the start of the arena (closing all holes).

        Only used without a next tier: with one, the oldest records are spilled instead.
        """
        live = [e for e in self._log if e[2] is not None]
        total = sum(e[1] for e in live)
        scratch = np.empty(total, dtype=np.uint8)
        pos = 0
        for e in live:
            scratch[pos:pos + e[1]] = self._np[e[0]:e[0] + e[1]]
            pos += e[1]
        self._np[:total] = scratch
        pos = 0
        for e in live:  # the index holds these same entry lists, so it follows the move
            e[0] = pos
            pos += e[1]
        self._log = deque(live)
        self._defrags += 1

    # -- overflow ---------------------------------------------------------------------------
    def _put_over(self, key: str, value, size: int) -> bool:
        """Keep a copy of ``value`` outside the arena (spill failed); False past ``overflow_bytes``."""
        old = self.record_bytes(key, len(self._over[key])) if key in self._over else 0
        if self._over_used - old + size > self.overflow_bytes:
            return False
        data = value.cpu().numpy().tobytes() if isinstance(value, torch.Tensor) else bytes(value)
        self._delete_ring(key)
        self._over.pop(key, None)
        self._over[key] = data
        self._over_used += size - old
        self._over_puts += 1
        self._over_peak = max(self._over_peak, self._over_used)
        self._stats.puts += 1
        self._stats.bytes_in += len(data)
        return True

    def _drop_over(self, key: str) -> bool:
        data = self._over.pop(key, None)
        if data is not None:
            self._over_used -= self.record_bytes(key, len(data))
        return data is not None

    def _drain_over(self) -> bool:
        """Hand the overflow to ``spill``, oldest first, in ``spill_batch_bytes`` batches; the
        ones it took leave this tier. False when it fails (they stay)."""
        while self._over:
            batch, nbytes = [], 0
            for key, data in self._over.items():
                if batch and nbytes >= self.spill_batch_bytes:
                    break
                batch.append((key, data))
                nbytes += len(data)
            try:
                self.spill([(k, memoryview(d)) for k, d in batch])
            except Exception as exc:  # as for the ring: keep them, report
                self._spill_errors += 1
                self.last_spill_error = exc
                log.warning("HostTier spill of its overflow failed, keeping %d records: %r", len(batch), exc)
                return False
            for key, data in batch:
                if self._over.get(key) is data:  # spill may have deleted or replaced it
                    self._drop_over(key)
            self._spills += 1
            self._spilled_records += len(batch)
            self._spilled_bytes += nbytes
        return True

    # -- put/get ----------------------------------------------------------------------------
    def put(self, key: str, value: BytesLike) -> bool:
        """Append a copy of ``value``; spills the oldest records if needed. False if it cannot fit."""
        check_key(key)
        kb = key.encode("utf-8")
        # device tensors are copied by torch (D2H); host data goes through the byte view
        is_tensor = isinstance(value, torch.Tensor) and value.device.type != "cpu"
        if is_tensor:
            src = value.detach().contiguous().reshape(-1)
            src = src if src.dtype == torch.uint8 else src.view(torch.uint8)
            n = src.numel()
        else:
            mv = as_byte_view(value)
            n = mv.nbytes
        size = _align(_HDR.size + len(kb) + n)
        if size > self._cap:
            raise ValueError(f"value is {n} bytes; a record must fit the ring of {self._cap} bytes "
                             f"(value limit {self._cap - _align(_HDR.size + len(kb))} bytes for this key)")
        with self._lock:
            if self._closed:
                raise TierClosedError("HostTier is closed")
            while (off := self._place(size)) is None:
                self._drop_tail_holes()
                if self._place(size) is not None:
                    continue
                if self.spill is None:
                    # no next tier: holes pinned behind a live tail record are still room
                    if self._live + size > self._cap:
                        return False
                    self._defragment()
                elif not self._spill_batch():
                    return self._put_over(key, src if is_tensor else mv, size)
                elif self._over:
                    self._drain_over()  # the next tier takes records again: overflow first
            voff = off + _HDR.size + len(kb)
            self._mv[off + _HDR.size:voff] = kb
            if is_tensor:
                self.arena[voff:voff + n].copy_(src)
            elif n >= _TORCH_COPY_MIN:
                with warnings.catch_warnings():  # read-only sources are only read here
                    warnings.simplefilter("ignore", UserWarning)
                    self.arena[voff:voff + n].copy_(torch.frombuffer(mv, dtype=torch.uint8))
            elif n:
                self._mv[voff:voff + n] = mv
            crc = crc32(self._mv[voff:voff + n], crc32(kb)) if self.checksum else 0
            _HDR.pack_into(self._mv, off, _MAGIC, len(kb), 0, n, crc)
            ent = [off, size, key]
            self._log.append(ent)
            old = self._index.get(key)
            if old is not None:
                old[2] = None
                self._live -= old[1]
                self._drop_tail_holes()
            self._drop_over(key)
            self._index[key] = ent
            self._vlen[key] = n
            self._live += size
            self._stats.puts += 1
            self._stats.bytes_in += n
            return True

    def _locate(self, key: str) -> tuple[int, int] | None:
        check_key(key)
        if self._closed:
            raise TierClosedError("HostTier is closed")
        self._stats.gets += 1
        ent = self._index.get(key)
        if ent is None:
            self._stats.misses += 1
            return None
        voff = ent[0] + _HDR.size + len(key.encode("utf-8"))
        n = self._vlen[key]
        if self.checksum:
            magic, klen, _, vlen, crc = _HDR.unpack_from(self._mv, ent[0])
            ok = magic == _MAGIC and vlen == n and \
                crc32(self._mv[voff - klen:voff + n]) == crc
            assert ok, f"HostTier record for {key!r} failed its checksum (arena overwritten)"
        self._stats.hits += 1
        self._stats.bytes_out += n
        return voff, n

    def get(self, key: str) -> bytes | None:
        """An owned copy of the value, or None."""
        with self._lock:
            if key in self._over:
                return self._count_over(key)
            loc = self._locate(key)
            if loc is None:
                return None
            voff, n = loc
            return self._mv[voff:voff + n].tobytes()

    def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        """:meth:`get` of each key under one hold of the lock (a swap-in reads a batch)."""
        out: list[bytes | None] = []
        with self._lock:
            for key in keys:
                if key in self._over:
                    out.append(self._count_over(key))
                    continue
                loc = self._locate(key)
                out.append(None if loc is None else self._mv[loc[0]:loc[0] + loc[1]].tobytes())
        return out

    def _count_over(self, key: str) -> bytes:
        if self._closed:
            raise TierClosedError("HostTier is closed")
        data = self._over[key]
        self._stats.gets += 1
        self._stats.hits += 1
        self._stats.bytes_out += len(data)
        return data

    def get_into(self, key: str, out: memoryview | bytearray | torch.Tensor) -> int | None:
        """Copy the value into ``out`` (a writable buffer or tensor, CPU or CUDA) from its start.

        Returns the number of bytes written, or None when absent. The copy is complete on return.
        """
        check_key(key)
        with self._lock:
            n = self.value_size(key)
            mv, dev = out_view(out, n or 0)  # checked before counting the read
            if key in self._over:
                data = self._count_over(key)
                if dev is not None:
                    if n:
                        dev[:n].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                else:
                    mv[:n] = data
                return n
            loc = self._locate(key)
            if loc is None:
                return None
            voff, n = loc
            if dev is not None:
                dev[:n].copy_(self.arena[voff:voff + n])
            elif n >= _TORCH_COPY_MIN:
                torch.frombuffer(mv, dtype=torch.uint8, count=n).copy_(self.arena[voff:voff + n])
            else:
                mv[:n] = self._mv[voff:voff + n]
            return n

    def value_size(self, key: str) -> int | None:
        check_key(key)
        data = self._over.get(key)
        return len(data) if data is not None else self._vlen.get(key)

    def contains(self, key: str) -> bool:
        check_key(key)
        return key in self._index or key in self._over

    def delete(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            if self._closed:
                raise TierClosedError("HostTier is closed")
            return self._delete_ring(key) or self._drop_over(key)

    def _delete_ring(self, key: str) -> bool:
        ent = self._index.pop(key, None)
        if ent is None:
            return False
        del self._vlen[key]
        ent[2] = None
        self._live -= ent[1]
        self._drop_tail_holes()
        return True

    def keys(self) -> Iterator[str]:
        """Live keys, oldest record first (the order they would spill in), the overflow's last."""
        with self._lock:
            return iter([e[2] for e in self._log if e[2] is not None] + list(self._over))

    def __len__(self) -> int:
        return len(self._index) + len(self._over)

    def stats(self) -> dict:
        with self._lock:
            d = self._stats.as_dict()
            span = 0
            if self._log:
                head, tail = self._head_tail()
                span = head - tail if tail < head else self._cap - tail + head
            d.update(used_bytes=self.used_bytes, capacity_bytes=self._cap, records=len(self),
                     spills=self._spills, spilled_records=self._spilled_records,
                     spilled_bytes=self._spilled_bytes, spill_errors=self._spill_errors,
                     ring_span_bytes=span, defragments=self._defrags, pinned=self.pinned,
                     overflow_records=len(self._over), overflow_used_bytes=self._over_used,
                     overflow_capacity_bytes=self.overflow_bytes, overflow_puts=self._over_puts,
                     overflow_peak_bytes=self._over_peak)
            return d

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._index.clear()
            self._vlen.clear()
            self._log.clear()
            self._live = 0
            self._over.clear()
            self._over_used = 0
