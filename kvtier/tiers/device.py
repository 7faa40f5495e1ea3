"""L1: a paged pool of fixed-size block slots on the model's device.

```
 pool: [num_slots, *slot_shape]   one tensor, allocated once (address space; see Memory)
        slot 0 | slot 1 | ... | slot n-1
 key -> slot            (live)
 free  : deque of slots ready to hand out
 fenced: [(slot, fence)] slots whose contents are still being copied out; a slot moves to
         ``free`` only once its fence reports completion (CUDA event, Future, threading.Event)
```

Ownership: ``put`` copies into the slot (casting tensors to the pool dtype); ``get`` returns an
owned ``bytes``; ``get_tensor`` returns a view that aliases the pool and is valid until the key is
deleted, overwritten or moved. No allocation happens per block in steady state.

Memory: on a CPU device the pool is an anonymous private mapping the OS fills with zeros page
by page on first write, so RSS grows with the slots really used up to ``capacity_bytes``: a
store sized for 4 sequences x 32k tokens costs what one short chat writes, not the budget
(tests/tiers/test_device_memory.py). Pages stay committed once written (no slot is unmapped
again). On a GPU the pool is reserved and zeroed at construction: CUDA memory is not committed
lazily, and a budget that does not fit should fail at attach, not mid-generation.

Two options serve a caller that lays blocks out itself (the KV store's per-table regions):
- ``slot_axis``: where the slot index sits in the physical tensor ``storage``. With
  ``slot_shape = (2, kv_heads, bt, hd)`` and ``slot_axis=2`` the storage is
  ``[2, kv_heads, num_slots, bt, hd]``, so for one K/V plane and head, slots s..s+n are one
  contiguous run of ``n * bt`` tokens. ``pool`` is always ``[num_slots, *slot_shape]`` (a view).
- ``placed_slots``: slots ``[0, placed_slots)`` are never handed out by ``put``; the caller
  chooses them with ``put_at`` and rearranges them with ``move``/``swap``.

``grow`` adds slots at the end (placed ones, then free ones): a new pool is allocated and the
live slots copied into it, so every view of the old pool (``pool``, ``storage``, ``get_tensor``)
goes stale; the owner re-reads them and keeps writers off the pool meanwhile.
"""
from __future__ import annotations

import mmap
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from math import prod

import numpy as np
import torch

from .base import BytesLike, Tier, TierStats, as_byte_view, check_key, out_view
from .errors import TierClosedError

_TENSOR = -1  # _length marker: the slot holds a tensor put, not a bytes put


def _fence_done(fence: object) -> bool:
    if isinstance(fence, Future):
        return fence.done()
    if isinstance(fence, threading.Event):
        return fence.is_set()
    if hasattr(torch, "cuda") and isinstance(fence, torch.cuda.Event):
        return fence.query()
    raise AssertionError(f"unchecked fence type {type(fence).__name__}")


def _check_fence(fence: object, field: str) -> None:
    ok = isinstance(fence, (Future, threading.Event)) or isinstance(fence, torch.cuda.Event)
    if not ok:
        raise ValueError(
            f"{field} must be a torch.cuda.Event, concurrent.futures.Future or threading.Event, "
            f"got {type(fence).__name__}"
        )


# Below this the pool is an ordinary allocation: lazy pages do not pay for a few slots.
_LAZY_MIN_BYTES = 1 << 20


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU, large ones are backed by pages committed on first write."""
    nbytes = prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < _LAZY_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    # MAP_PRIVATE: not shared memory (a fork does not share the pool); anonymous pages read as
    # zeros until written. No transparent huge pages: one touched slot would commit 2 MiB.
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mm.madvise(mmap.MADV_NOHUGEPAGE)
    # the tensor holds a reference to the mapping: it is unmapped when the last view goes
    return torch.frombuffer(mm, dtype=torch.uint8).view(dtype).view(shape)


class DeviceTier(Tier):
    """Fixed-slot block pool on ``device``.

    Args:
        slot_shape: shape of one slot, e.g. ``(2, kv_heads, block_tokens, head_dim)``.
        num_slots: number of slots (>= 1).
        dtype: pool dtype; tensor puts are cast to it.
        device: where the pool lives ("cpu", "cuda", "cuda:1", ...).
        slot_axis: position of the slot index in ``storage`` (0: slot-major, ``storage is pool``).
        placed_slots: leading slots handed out only by ``put_at`` (0: none).
    """

    name = "device"

    def __init__(self, slot_shape: tuple[int, ...], num_slots: int, dtype: torch.dtype = torch.float16,
                 device: str | torch.device = "cpu", slot_axis: int = 0, placed_slots: int = 0) -> None:
        slot_shape = tuple(slot_shape)
        if not slot_shape or any((not isinstance(d, int)) or d < 1 for d in slot_shape):
            raise ValueError(f"slot_shape must be a non-empty tuple of positive ints, got {slot_shape!r}")
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
        if isinstance(slot_axis, bool) or not isinstance(slot_axis, int) or not 0 <= slot_axis <= len(slot_shape):
            raise ValueError(f"slot_axis must be an int in [0, {len(slot_shape)}], got {slot_axis!r}")
        if isinstance(placed_slots, bool) or not isinstance(placed_slots, int) or not 0 <= placed_slots <= num_slots:
            raise ValueError(f"placed_slots must be an int in [0, num_slots={num_slots}], got {placed_slots!r}")
        self.slot_shape = slot_shape
        self.num_slots = num_slots
        self.dtype = dtype
        self.device = torch.device(device)
        self.slot_axis = slot_axis
        self.placed_slots = placed_slots
        self.slot_bytes = prod(slot_shape) * torch.empty((), dtype=dtype).element_size()
        self._bind(self._allocate(num_slots))
        # 1 where a slot is placed (handed out by put_at only): a prefix at first, and each
        # grow() appends placed slots past the free ones it added before
        self._placed_mask = bytearray(b"\x01") * placed_slots + bytearray(num_slots - placed_slots)
        self._slot: dict[str, int] = {}
        self._length: dict[str, int] = {}  # byte length of a bytes put, _TENSOR for tensor puts
        self._fence: dict[int, list] = {}  # fences on live slots (mark_pending); placed slots keep
                                           # theirs here after release until the fences complete
        self._placed: dict[int, str] = {}  # placed slot -> key (live placed slots)
        self._free: deque[int] = deque(range(placed_slots, num_slots))
        self._fenced: list[tuple[int, list]] = []  # released slots waiting for all their fences
        self._lock = threading.RLock()
        self._stats = TierStats()
        self._closed = False

    def _allocate(self, num_slots: int) -> torch.Tensor:
        """A zeroed storage tensor of ``num_slots`` slots; MemoryError naming the bytes when the
        device cannot hold it."""
        ax = self.slot_axis
        phys = (*self.slot_shape[:ax], num_slots, *self.slot_shape[ax:])
        try:
            return _zeros(phys, self.dtype, self.device)
        except (RuntimeError, MemoryError, OSError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            raise MemoryError(f"DeviceTier: a pool of {num_slots} slots ({num_slots * self.slot_bytes:,} "
                              f"bytes) does not fit {self.device}: {exc}") from exc

    def _bind(self, storage: torch.Tensor) -> None:
        self.storage = storage
        self.pool = storage.movedim(self.slot_axis, 0)  # [num_slots, *slot_shape]
        # [num_slots, slot_bytes] byte view of the pool (slot-major only; else a slot's bytes are
        # gathered per access); numpy view on CPU for cheap byte copies
        self._bytes = self.pool.view(self.num_slots, -1).view(torch.uint8) if self.slot_axis == 0 else None
        self._np = self._bytes.numpy() if self._bytes is not None and self.device.type == "cpu" else None
        # CPU: the storage's bytes as numpy [outer, num_slots, inner bytes] (outer: the slot dims
        # before slot_axis), where one fancy assignment fills many slots (put_many_at)
        self._np_slots = None
        if self.device.type == "cpu":
            outer = prod(self.slot_shape[:self.slot_axis])
            self._np_slots = storage.view(-1).view(torch.uint8).numpy().reshape(outer, self.num_slots, -1)

    def grow(self, placed: int, free: int) -> int:
        """Add ``placed`` placed slots and then ``free`` slots for ``put`` at the end of the pool.

        The pool is reallocated and the slots holding keys are copied (on a CPU device only
        those pages are committed); slot numbers and keys stay as they were. Views of the old
        pool stay valid for reading what it held, but writes through them are lost: the caller
        holds writers off and re-reads ``pool``/``storage``.

        Returns:
            the first new placed slot (``num_slots`` before the call).
        Raises:
            MemoryError naming the bytes when the device cannot hold the larger pool (nothing
            changed).
        """
        for name, v in (("placed", placed), ("free", free)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0; got {v!r}")
        with self._lock:
            self._check_open()
            first = self.num_slots
            n = first + placed + free
            storage = self._allocate(n)
            live = sorted(self._slot.values())
            if live:
                idx = torch.tensor(live, device=self.device)
                storage.index_copy_(self.slot_axis, idx, self.storage.index_select(self.slot_axis, idx))
            self.num_slots = n
            self._bind(storage)
            self._placed_mask += bytearray(b"\x01") * placed + bytearray(free)
            self.placed_slots += placed
            self._free.extend(range(first + placed, n))
            return first

    def is_placed(self, slot: int) -> bool:
        """Whether ``slot`` is a placed slot (handed out by ``put_at`` only)."""
        return 0 <= slot < self.num_slots and bool(self._placed_mask[slot])

    # -- capacity ---------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of slots holding live keys (slot granularity)."""
        return len(self._slot) * self.slot_bytes

    @property
    def free_slots(self) -> int:
        """Slots that a put could take now (fenced slots whose copy completed included)."""
        with self._lock:
            self._reclaim()
            return len(self._free)

    @property
    def pending_slots(self) -> int:
        """Slots released but still waiting for a copy out of them to complete."""
        with self._lock:
            self._reclaim()
            return len(self._fenced)

    def _reclaim(self) -> None:
        if self._fenced:
            still = []
            for slot, fences in self._fenced:
                if all(_fence_done(f) for f in fences):
                    self._free.append(slot)
                else:
                    still.append((slot, fences))
            self._fenced = still

    def _release(self, slot: int) -> None:
        fences = [f for f in self._fence.pop(slot, ()) if not _fence_done(f)]
        if self._placed_mask[slot]:
            self._placed.pop(slot, None)
            if fences:  # put_at/move refuse the slot until they complete
                self._fence[slot] = fences
            return
        if fences:
            self._fenced.append((slot, fences))
        else:
            self._free.append(slot)

    def _take(self) -> int | None:
        if not self._free:
            self._reclaim()
        return self._free.popleft() if self._free else None

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError("DeviceTier is closed")

    # -- put/get ----------------------------------------------------------------------------
    def put(self, key: str, value: BytesLike) -> bool:
        """Copy ``value`` into a slot: a ``slot_shape`` tensor (cast to the pool dtype), or a
        bytes-like (uint8 tensors of another shape included) of at most ``slot_bytes``.

        Returns False (changing nothing) when no slot is free.
        """
        check_key(key)
        is_tensor = isinstance(value, torch.Tensor)
        if is_tensor and value.dtype == torch.uint8 and tuple(value.shape) != self.slot_shape:
            is_tensor = False  # a uint8 tensor of another shape is a bytes payload
        if is_tensor:
            if tuple(value.shape) != self.slot_shape:
                raise ValueError(f"value tensor must have shape {self.slot_shape} (or be uint8 bytes), "
                                 f"got {tuple(value.shape)}")
            if not (value.is_floating_point() or value.dtype == self.dtype):
                raise ValueError(f"value tensor must be floating point or {self.dtype}, got {value.dtype}")
            nbytes = self.slot_bytes
        else:
            mv = as_byte_view(value)
            nbytes = mv.nbytes
            if nbytes > self.slot_bytes:
                raise ValueError(f"value is {nbytes} bytes, over the slot limit of {self.slot_bytes} bytes")
        with self._lock:
            self._check_open()
            old = self._slot.get(key)
            # overwrite in place unless someone is still copying out of the old slot
            if old is not None and all(_fence_done(f) for f in self._fence.get(old, ())):
                self._fence.pop(old, None)
                slot = old
            else:
                slot = self._take()
                if slot is None:
                    return False
            if is_tensor:
                self.pool[slot].copy_(value)
                self._length[key] = _TENSOR
            else:
                self._write_bytes(slot, mv, nbytes)
                self._length[key] = nbytes
            if old is not None and old != slot:
                self._release(old)
            self._slot[key] = slot
            self._stats.puts += 1
            self._stats.bytes_in += nbytes
            return True

    def _slot_u8(self, slot: int) -> torch.Tensor:
        """A slot's bytes, [slot_bytes] uint8: a view when slot-major, else a copy."""
        if self._bytes is not None:
            return self._bytes[slot]
        return self.pool[slot].contiguous().view(-1).view(torch.uint8)

    def _write_bytes(self, slot: int, mv: memoryview, nbytes: int) -> None:
        if not nbytes:
            return
        if self._np is not None:
            self._np[slot, :nbytes] = np.frombuffer(mv, dtype=np.uint8)
            return
        src = torch.from_numpy(np.frombuffer(mv, dtype=np.uint8).copy())
        if self._bytes is not None:
            self._bytes[slot, :nbytes].copy_(src)
            return
        whole = self.pool[slot].contiguous()  # [*slot_shape], a copy: the slot is strided
        whole.view(-1).view(torch.uint8)[:nbytes].copy_(src)
        self.pool[slot].copy_(whole)

    # -- placed slots -----------------------------------------------------------------------
    def _placed_free(self, slot: int) -> bool:
        """Whether placed slot ``slot`` holds no key and no copy out of it is still running."""
        if slot in self._placed:
            return False
        fences = self._fence.get(slot)
        if fences:
            if not all(_fence_done(f) for f in fences):
                return False
            del self._fence[slot]
        return True

    def _check_placed(self, slot: object) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not self.is_placed(slot):
            raise ValueError(f"slot must be a placed slot (in [0, {self.placed_slots}) before any "
                             f"grow()), got {slot!r}")

    def put_at(self, key: str, slot: int, value: torch.Tensor | None) -> bool:
        """Bind the new key ``key`` to placed slot ``slot`` and copy ``value`` (a ``slot_shape``
        tensor, cast to the pool dtype) into it; ``None`` leaves the slot's contents as they are.

        Returns False (changing nothing) when the slot is taken or still being copied out of.
        """
        check_key(key)
        self._check_placed(slot)
        if value is not None and (not isinstance(value, torch.Tensor) or tuple(value.shape) != self.slot_shape):
            raise ValueError(f"value must be None or a tensor of shape {self.slot_shape}, got "
                             f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}")
        with self._lock:
            self._check_open()
            if key in self._slot:
                raise ValueError(f"key {key!r} is already in this DeviceTier; move() relocates it")
            if not self._placed_free(slot):
                return False
            if value is not None:
                self.pool[slot].copy_(value)
            self._length[key] = _TENSOR
            self._slot[key] = slot
            self._placed[slot] = key
            self._stats.puts += 1
            self._stats.bytes_in += self.slot_bytes
            return True

    def put_many_at(self, keys: list[str], slots: list[int], values: list[torch.Tensor] | None) -> int | None:
        """:meth:`put_at` of each (key, slot, value) under one hold of the lock, all or none:
        returns None when every one was bound and copied, else the position of the first one
        refused (its slot taken, or still being copied out of), changing nothing. ``values``
        None binds the keys and leaves the slots' contents as they are (``put_at``'s None)."""
        if not len(keys) == len(slots) == (len(keys) if values is None else len(values)):
            raise ValueError(f"keys, slots and values must be as many; got {len(keys)}, {len(slots)}, "
                             f"{len(values)}")
        shape = self.slot_shape
        for key, slot in zip(keys, slots):
            check_key(key)
            self._check_placed(slot)
        for value in values or ():
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                raise ValueError(f"values must be tensors of shape {shape}, got "
                                 f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}")
        if len(set(keys)) != len(keys) or len(set(slots)) != len(slots):
            raise ValueError("keys and slots must each be distinct")
        with self._lock:
            self._check_open()
            for i, (key, slot) in enumerate(zip(keys, slots)):
                if key in self._slot:
                    raise ValueError(f"key {key!r} is already in this DeviceTier; move() relocates it")
                if not self._placed_free(slot):
                    return i
            if values is not None:
                self._copy_in(slots, values)
            for key, slot in zip(keys, slots):
                self._length[key] = _TENSOR
                self._slot[key] = slot
                self._placed[slot] = key
            self._stats.puts += len(keys)
            self._stats.bytes_in += len(keys) * self.slot_bytes
            return None

    def _copy_in(self, slots: list[int], values: list[torch.Tensor]) -> None:
        """``values[i]`` (``slot_shape`` tensors) into ``slots[i]``: views of one batch tensor on a
        CPU pool (a batched decode's blocks) in one numpy assignment, else a copy per slot."""
        batch = self._batch_of(values) if self._np_slots is not None and len(values) > 1 else None
        if batch is None:
            pool = self.pool
            for slot, value in zip(slots, values):
                pool[slot].copy_(value)
            return
        src = batch.view(-1).view(torch.uint8).numpy().reshape(len(values), self._np_slots.shape[0], -1)
        self._np_slots[:, slots, :] = src.transpose(1, 0, 2)

    def _batch_of(self, values: list[torch.Tensor]) -> torch.Tensor | None:
        """``values`` as rows of one contiguous ``[n, *slot_shape]`` tensor of the pool's dtype
        and device when each is a row of the same such tensor (a copy of the rows it picks, unless
        they are all of its rows in order), else None."""
        base = values[0]._base
        if base is None or base.dtype != self.dtype or base.device != self.device \
                or tuple(base.shape[1:]) != self.slot_shape or not base.is_contiguous():
            return None
        start, size = base.data_ptr(), self.slot_bytes
        rows = []
        for v in values:
            off = v.data_ptr() - start
            if v._base is not base or off % size or not v.is_contiguous():
                return None
            rows.append(off // size)
        if rows == list(range(base.shape[0])):
            return base
        return base[rows]

    def move(self, key: str, slot: int, copy: bool = True) -> bool:
        """Copy the contents of ``key``'s slot into the free placed slot ``slot`` and rebind the
        key there; its old slot is released. False (changing nothing) if ``slot`` is not free.
        ``copy=False`` only rebinds: the caller copies what it needs of the old slot (before
        anything else may take it)."""
        check_key(key)
        self._check_placed(slot)
        with self._lock:
            self._check_open()
            old = self._slot.get(key)
            if old is None:
                raise ValueError(f"key {key!r} is not in this DeviceTier")
            if old == slot:
                return True
            if not self._placed_free(slot):
                return False
            if copy:
                self.pool[slot].copy_(self.pool[old])  # [*slot_shape]
            self._slot[key] = slot
            self._placed[slot] = key
            self._release(old)
            return True

    def swap(self, key_a: str, key_b: str) -> bool:
        """Exchange the slots of two keys (both placed), contents included: three slot copies.
        False (changing nothing) while a copy out of either slot is still running."""
        check_key(key_a)
        check_key(key_b)
        with self._lock:
            self._check_open()
            a, b = self._slot.get(key_a), self._slot.get(key_b)
            if a is None or b is None:
                raise ValueError(f"keys must both be in this DeviceTier; got {key_a!r} -> {a}, {key_b!r} -> {b}")
            if not (self._placed_mask[a] and self._placed_mask[b]):
                raise ValueError(f"swap needs two placed slots (< {self.placed_slots}); got {a} and {b}")
            if not all(_fence_done(f) for f in (*self._fence.get(a, ()), *self._fence.get(b, ()))):
                return False
            tmp = self.pool[a].clone()  # [*slot_shape]
            self.pool[a].copy_(self.pool[b])
            self.pool[b].copy_(tmp)
            self._slot[key_a], self._slot[key_b] = b, a
            self._placed[a], self._placed[b] = key_b, key_a
            return True

    def get(self, key: str) -> bytes | None:
        """Owned bytes: exactly what a bytes put stored, or the slot's raw bytes for a tensor put."""
        check_key(key)
        with self._lock:
            self._check_open()
            self._stats.gets += 1
            slot = self._slot.get(key)
            if slot is None:
                self._stats.misses += 1
                return None
            n = self._length[key]
            n = self.slot_bytes if n == _TENSOR else n
            if self._np is not None:
                out = self._np[slot, :n].tobytes()
            else:
                out = self._slot_u8(slot)[:n].cpu().numpy().tobytes()
            self._stats.hits += 1
            self._stats.bytes_out += n
            return out

    def get_into(self, key: str, out: memoryview | bytearray | torch.Tensor) -> int | None:
        """Copy what ``get`` would return straight from the slot into ``out``; bytes written or None."""
        check_key(key)
        with self._lock:
            self._check_open()
            n = self._length.get(key)
            n = self.slot_bytes if n == _TENSOR else (n or 0)
            mv, dev = out_view(out, n)  # checked before counting the read
            self._stats.gets += 1
            slot = self._slot.get(key)
            if slot is None:
                self._stats.misses += 1
                return None
            if dev is not None:
                dev[:n].copy_(self._slot_u8(slot)[:n])
            elif self._np is not None:
                mv[:n] = memoryview(self._np[slot, :n])
            else:
                mv[:n] = memoryview(self._slot_u8(slot)[:n].cpu().numpy())
            self._stats.hits += 1
            self._stats.bytes_out += n
            return n

    def get_tensor(self, key: str) -> torch.Tensor | None:
        """The slot as a ``slot_shape`` tensor aliasing the pool (valid until delete/overwrite)."""
        check_key(key)
        with self._lock:
            self._check_open()
            slot = self._slot.get(key)
            self._stats.gets += 1
            if slot is None:
                self._stats.misses += 1
                return None
            self._stats.hits += 1
            self._stats.bytes_out += self.slot_bytes
            return self.pool[slot]

    def slot_of(self, key: str) -> int | None:
        check_key(key)
        return self._slot.get(key)

    def contains(self, key: str) -> bool:
        check_key(key)
        return key in self._slot

    def mark_pending(self, key: str, event: object) -> None:
        """Record that the slot of ``key`` is being copied out until ``event`` completes.

        The slot is not handed out again (after delete or overwrite) before that.
        """
        check_key(key)
        _check_fence(event, "event")
        with self._lock:
            slot = self._slot.get(key)
            if slot is None:
                raise ValueError(f"key {key!r} is not in this DeviceTier")
            self._fence.setdefault(slot, []).append(event)

    def delete(self, key: str, fence: object = None) -> bool:
        """Free the slot of ``key``; with ``fence``, not before ``fence`` completes."""
        check_key(key)
        if fence is not None:
            _check_fence(fence, "fence")
        with self._lock:
            self._check_open()
            slot = self._slot.pop(key, None)
            if slot is None:
                return False
            del self._length[key]
            if fence is not None:
                self._fence.setdefault(slot, []).append(fence)
            self._release(slot)
            return True

    def delete_many(self, keys: Iterable[str]) -> list[bool]:
        """:meth:`delete` of each key (no fence) under one hold of the lock."""
        keys = list(keys)
        for key in keys:
            check_key(key)
        out = []
        with self._lock:
            self._check_open()
            for key in keys:
                slot = self._slot.pop(key, None)
                if slot is not None:
                    del self._length[key]
                    self._release(slot)
                out.append(slot is not None)
        return out

    def keys(self) -> Iterator[str]:
        return iter(list(self._slot))

    def __len__(self) -> int:
        return len(self._slot)

    def stats(self) -> dict:
        with self._lock:
            self._reclaim()
            d = self._stats.as_dict()
            d.update(used_bytes=self.used_bytes, capacity_bytes=self.capacity_bytes,
                     records=len(self._slot), slot_bytes=self.slot_bytes,
                     free_slots=len(self._free), pending_slots=len(self._fenced))
            return d

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._slot.clear()
            self._length.clear()
            self._placed.clear()
