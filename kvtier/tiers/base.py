"""The tier interface: a bounded key -> bytes store.

Tiers know nothing of codecs, policies or sequences: they keep the bytes they are given under
a string key, within a byte capacity. The store decides what goes where.

Ownership: ``put`` copies the value (the caller may reuse its buffer at once); ``get`` returns a
bytes-like object the caller owns, which later puts/deletes never change.
Capacity: a ``put`` that does not fit returns ``False`` and changes nothing; the caller decides.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import Union

import numpy as np
import torch

BytesLike = Union[bytes, bytearray, memoryview, torch.Tensor]

MAX_KEY_BYTES = 255


def check_key(key: object) -> str:
    """Validate a tier key: a non-empty str of at most 255 UTF-8 bytes without NUL."""
    if not isinstance(key, str):
        raise ValueError(f"key must be a str, got {type(key).__name__}")
    raw = key.encode("utf-8")
    if not raw or len(raw) > MAX_KEY_BYTES or "\x00" in key:
        raise ValueError(f"key must be 1..{MAX_KEY_BYTES} UTF-8 bytes without NUL, got {key!r:.80}")
    return key


def as_byte_view(value: object, field: str = "value") -> memoryview:
    """A flat, C-contiguous, 1-byte-format view of ``value`` without copying where possible.

    Tensors are viewed as their raw bytes (a CUDA tensor is first copied to host: callers that
    care about the device path use the tensor directly). Raises ValueError for anything that is
    not bytes-like.
    """
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous().reshape(-1)
        if t.dtype != torch.uint8:
            t = t.view(torch.uint8)
        return memoryview(t.numpy()).cast("B")
    if isinstance(value, (bytes, bytearray, memoryview, np.ndarray)):
        mv = memoryview(value)
        if not mv.c_contiguous:
            raise ValueError(f"{field} must be C-contiguous bytes-like, got a strided view")
        return mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv
    raise ValueError(
        f"{field} must be bytes, bytearray, memoryview or torch.Tensor, got {type(value).__name__}"
    )


def out_view(out: object, need: int, field: str = "out") -> tuple[memoryview | None, torch.Tensor | None]:
    """Where ``get_into`` writes: (byte memoryview, None) for host buffers and CPU tensors, or
    (None, flat uint8 tensor) for device tensors. Raises ValueError unless ``out`` is writable,
    contiguous and holds at least ``need`` bytes."""
    if isinstance(out, torch.Tensor):
        if not out.is_contiguous():
            raise ValueError(f"{field} tensor must be contiguous")
        flat = out.view(-1)
        flat = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
        if flat.numel() < need:
            raise ValueError(f"{field} holds {flat.numel()} bytes, the value needs {need}")
        if flat.device.type != "cpu":
            return None, flat
        out = flat.numpy()
    try:
        mv = memoryview(out)
    except TypeError:
        raise ValueError(f"{field} must be a writable buffer or tensor, got {type(out).__name__}") from None
    if mv.readonly or not mv.c_contiguous:
        raise ValueError(f"{field} must be a writable, C-contiguous buffer")
    mv = mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv
    if mv.nbytes < need:
        raise ValueError(f"{field} holds {mv.nbytes} bytes, the value needs {need}")
    return mv, None


class TierStats:
    """Counters every tier reports (plain ints, so ``as_dict`` is JSON-able)."""

    FIELDS = ("puts", "gets", "hits", "misses", "bytes_in", "bytes_out")

    def __init__(self) -> None:
        for f in self.FIELDS:
            setattr(self, f, 0)

    def as_dict(self) -> dict:
        return {f: int(getattr(self, f)) for f in self.FIELDS}


class Tier(ABC):
    """A bounded key -> bytes store. Batched methods loop by default; tiers override them."""

    name: str = "tier"

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @abstractmethod
    def put(self, key: str, value: BytesLike) -> bool:
        """Store a copy of ``value`` under ``key`` (replacing any old value). False when it does not fit."""

    @abstractmethod
    def get(self, key: str) -> bytes | bytearray | memoryview | None:
        """The stored bytes, or None when absent (or, for persistent tiers, corrupt)."""

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it was present."""

    @abstractmethod
    def keys(self) -> Iterator[str]: ...

    def __len__(self) -> int:
        return sum(1 for _ in self.keys())

    def __contains__(self, key: str) -> bool:
        return self.contains(key)

    def get_into(self, key: str, out: memoryview | bytearray | torch.Tensor) -> int | None:
        """Copy the value into ``out`` (a writable buffer or contiguous tensor, any device) from
        its start; returns the bytes written, or None when absent. This default goes through
        ``get``; tiers override it to skip the intermediate copy."""
        value = self.get(key)
        if value is None:
            return None
        src = as_byte_view(value)
        mv, dev = out_view(out, src.nbytes)
        if mv is not None:
            mv[:src.nbytes] = src
        elif src.nbytes:
            dev[:src.nbytes].copy_(torch.frombuffer(bytearray(src), dtype=torch.uint8))
        return src.nbytes

    def value_size(self, key: str) -> int | None:
        """Length in bytes of the value under ``key``, or None when absent. This default reads
        the value; tiers override it with a lookup in their index (the value is not read, so
        a damaged one is only found when it is read)."""
        value = self.get(key)
        return None if value is None else as_byte_view(value).nbytes

    def value_sizes(self, keys: Iterable[str]) -> list[int | None]:
        """:meth:`value_size` of every key (batched: one call per key unless overridden)."""
        return [self.value_size(k) for k in keys]

    def put_many(self, items: Iterable[tuple[str, BytesLike]]) -> list[bool]:
        return [self.put(k, v) for k, v in items]

    def get_many(self, keys: Iterable[str]) -> list[bytes | bytearray | memoryview | None]:
        return [self.get(k) for k in keys]

    def delete_many(self, keys: Iterable[str]) -> list[bool]:
        return [self.delete(k) for k in keys]

    def stats(self) -> dict:
        """JSON-able counters: puts, gets, hits, misses, bytes_in, bytes_out, used_bytes,
        capacity_bytes, records, plus tier-specific ones."""
        return {"used_bytes": self.used_bytes, "capacity_bytes": self.capacity_bytes,
                "records": len(self)}

    def sync(self) -> None:
        """Make everything put so far durable (no-op for volatile tiers)."""

    def close(self) -> None:
        """Release resources; the tier must not be used afterwards."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
