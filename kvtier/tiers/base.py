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

    def put_many(self, items: Iterable[tuple[str, BytesLike]]) -> list[bool]:
        return [self.put(k, v) for k, v in items]

    def get_many(self, keys: Iterable[str]) -> list[bytes | bytearray | memoryview | None]:
        return [self.get(k) for k in keys]

    def delete_many(self, keys: Iterable[str]) -> list[bool]:
        return [self.delete(k) for k in keys]

    def sync(self) -> None:
        """Make everything put so far durable (no-op for volatile tiers)."""

    def close(self) -> None:
        """Release resources; the tier must not be used afterwards."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
