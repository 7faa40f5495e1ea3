"""The codec interface: a block tensor in, an :class:`Encoded` out, and back.

A codec is a pure function pair. It never touches tiers or files: turning an ``Encoded`` into
bytes is :mod:`kvtier.compress.record`'s job, and lz4 is :mod:`kvtier.compress.bytestage`'s.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class Encoded:
    """One encoded tensor.

    Attributes:
        codec: codec name as given to ``get_codec`` (``"int4"``, ...).
        params: codec parameters needed to decode (JSON-able ints and strings only).
        shape: shape of the original tensor.
        dtype: dtype of the original tensor (what ``decode`` returns).
        parts: named tensors that make up the encoding, e.g. ``{"q": ..., "scale": ..., "zero": ...}``.
            Insertion order is the serialisation order.
    """

    codec: str
    params: dict
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """True stored size: every part, scales and zeros included (headers excluded)."""
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    @property
    def device(self) -> torch.device:
        return next(iter(self.parts.values())).device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Encoded":
        parts = {k: v.to(device, non_blocking=non_blocking) for k, v in self.parts.items()}
        return Encoded(self.codec, dict(self.params), tuple(self.shape), self.dtype, parts)


class Codec(ABC):
    """Encode/decode pair for KV block tensors.

    ``encode`` accepts a floating tensor (fp16, bf16 or fp32), typically one role of one block
    ``[kv_heads, block_tokens, head_dim]``; ``decode`` returns a tensor of the original shape and
    dtype on ``device`` (default: where the encoding lives).
    """

    name: str = ""

    @property
    @abstractmethod
    def params(self) -> dict:
        """Parameters that identify this codec's output format (JSON-able)."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> Encoded: ...

    @abstractmethod
    def decode(self, enc: Encoded, device: torch.device | str | None = None) -> torch.Tensor: ...

    @property
    def lossless(self) -> bool:
        return False

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{type(self).__name__}({args})"
