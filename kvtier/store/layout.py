"""Every size and codec name a store derives from its config and the model shape, computed once.

The parts of the store read these and never derive them again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtier.config import LOSSLESS_CODECS, KVTierConfig, lossless_codec

from .precision import PrecisionPlan
from .sizing import check_model
from .table import INT4, digest_row_bytes, digest_rows_held

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class Layout:
    """The resolved layout of one store (see :meth:`resolve` for the checks)."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    block_tokens: int
    slot_bytes: int          # one block (K and V) in L1, in the KV dtype
    device_blocks: int       # L1 region of one (sequence, layer), in blocks
    budget_tokens: int       # default tokens a sparse step attends, the open block included
    sink_blocks: int
    window_blocks: int
    high: int                # watermarks, in resident blocks per table
    low: int
    host_codec: str          # codec names with a 16-bit full precision one following the dtype
    disk_codec: str
    l2_staged: bool          # L2 records go through the byte stage too
    digest_score: str | None  # what select() ranks by; None: no digests kept (dense attention)
    digest_parts: int
    value_parts: int         # value means per block in the digest (rest_attention='estimate'), else 0
    select_per_head: bool    # each kv head's top blocks in turn (select_heads='per_head')
    stickiness: float        # resident candidates' score gain (select_stickiness)
    digest_dtype: torch.dtype  # the KV dtype, int8 (rows with float32 scales) or INT4 (packed, table.py)
    scratch_slots: int       # L1 slots past the regions, for misses while a region is full
    max_sequences: int
    precision: PrecisionPlan | None = None  # precision="importance": codec per evicted block

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def transcode(self) -> bool:
        """L2 and L3 use different codecs: a spill decodes and encodes again."""
        return self.host_codec != self.disk_codec

    @property
    def slot_shape(self) -> tuple[int, int, int, int]:
        return (2, self.kv_heads, self.block_tokens, self.head_dim)  # [2, kv_heads, bt, head_dim]

    def digest_bytes(self, tokens: int) -> tuple[int, int]:
        """Digest bytes of one (sequence, layer) table holding ``tokens`` tokens: (the rows
        of its sealed blocks, the rows its table holds with the room it grew to); (0, 0) without
        digests. A full block is sealed when the next token opens a block, so ``tokens`` tokens
        leave ``ceil(tokens / block_tokens) - 1`` blocks sealed."""
        if tokens < 1:
            return 0, 0
        sealed = -(-tokens // self.block_tokens) - 1
        return sealed * self.digest_row_bytes, digest_rows_held(sealed) * self.digest_row_bytes

    @property
    def digest_row_bytes(self) -> int:
        """Bytes of one sealed block's digest (key summaries, value means) in one layer, all kv
        heads (0 without digests)."""
        if self.digest_score is None:
            return 0
        return digest_row_bytes(self.kv_heads, self.head_dim, self.digest_score, self.digest_parts,
                                self.digest_dtype, self.value_parts)

    @classmethod
    def resolve(cls, cfg: KVTierConfig, num_layers: int, kv_heads: int, head_dim: int,
                dtype: torch.dtype, device: torch.device | str | None, machine: bool = True) -> "Layout":
        """Check the model shape against ``cfg`` and derive every size; ValueError naming the
        field on a shape or budget that cannot work. ``machine=False``: the sizes are not
        checked against this machine's memory (the layout of a store planned for another)."""
        if not isinstance(cfg, KVTierConfig):
            raise ValueError(f"cfg must be a KVTierConfig, got {type(cfg).__name__}")
        for name, v in (("num_layers", num_layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1; got {v!r}")
        if cfg.dtype is not None:
            dtype = DTYPES[cfg.dtype]
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of torch.float16, torch.bfloat16, torch.float32; got {dtype}")
        # -- config sizes against this model's shape (sizing.py owns the checks and messages:
        # each names the user's field and the bound in bytes), before anything is allocated --
        check_model(cfg, num_layers, kv_heads, head_dim, dtype, device, machine=machine)
        # -- end of the config checks --
        bt = cfg.block_tokens
        slot_bytes = 2 * kv_heads * bt * head_dim * torch.empty((), dtype=dtype).element_size()
        device_blocks = _device_blocks(cfg, slot_bytes, num_layers)
        budget = cfg.budget_tokens if cfg.budget_tokens is not None else device_blocks * bt
        if budget > device_blocks * bt:
            raise ValueError(f"budget_tokens must be <= the L1 budget ({device_blocks * bt} tokens); got {budget}")
        sink, window = cfg.sink_window(budget)
        sink_blocks, window_blocks = -(-sink // bt), -(-window // bt)
        if sink_blocks + window_blocks + 1 > budget // bt:
            raise ValueError(f"budget_tokens must be >= sink_tokens + window_tokens + one open block; "
                             f"got budget {budget} with sink_tokens={sink}, window_tokens={window}, "
                             f"block_tokens={bt} (L1 budget from device_bytes: {device_blocks} blocks)")
        high = min(device_blocks, max(1, math.ceil(cfg.high_watermark * device_blocks)))
        # A full-precision 16-bit tier codec follows the KV dtype (the config may be built before
        # the model's dtype is known; fp16 <-> bf16 would not be lossless and the codecs refuse it).
        lossless16 = lossless_codec(next(name for name, d in DTYPES.items() if d == dtype))

        def follow(name: str) -> str:
            return lossless16 if name in LOSSLESS_CODECS and dtype != torch.float32 else name

        return cls(
            num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
            device=torch.device(device if device is not None else "cpu"), block_tokens=bt,
            slot_bytes=slot_bytes, device_blocks=device_blocks, budget_tokens=budget, sink_blocks=sink_blocks,
            window_blocks=window_blocks, high=high,
            low=min(high, device_blocks - 1, max(0, math.floor(cfg.low_watermark * device_blocks))),
            host_codec=follow(cfg.host_codec), disk_codec=follow(cfg.disk_codec),
            l2_staged=cfg.byte_stage_l2 and cfg.byte_stage != "none",
            digest_score=cfg.select_score if cfg.attention == "sparse" else None,
            digest_parts=bt // cfg.digest_tokens,
            value_parts=bt // cfg.value_digest_tokens
            if cfg.attention == "sparse" and cfg.rest_attention == "estimate" else 0,
            select_per_head=cfg.select_heads == "per_head",
            stickiness=float(cfg.select_stickiness),
            digest_dtype=_digest_dtype(cfg, head_dim, dtype),
            scratch_slots=scratch_slots(device_blocks, cfg.max_sequences), max_sequences=cfg.max_sequences,
            precision=PrecisionPlan.of(cfg),
        )


def scratch_slots(device_blocks: int, max_sequences: int) -> int:
    """L1 slots past the regions: a selection fits in the budget, so one read needs at most
    ``device_blocks - 1`` scratch slots, and one read per live sequence may be in flight."""
    return max(1, device_blocks - 1) * max_sequences


def pool_slots(device_blocks: int, max_sequences: int, num_layers: int) -> int:
    """Slots of the L1 pool: one region of ``device_blocks`` per sequence and layer, then the
    scratch slots (``KVStore`` allocates exactly these; ``kvtier plan`` prints their bytes)."""
    return max_sequences * num_layers * device_blocks + scratch_slots(device_blocks, max_sequences)


def _digest_dtype(cfg: KVTierConfig, head_dim: int, dtype: torch.dtype) -> torch.dtype:
    """The digest table's dtype for ``cfg.digest_dtype``. int4 packs two channels a byte: with an
    odd ``head_dim`` the derived default falls back to int8 (a user's explicit int4 was refused by
    ``check_model``)."""
    if cfg.digest_dtype == "int4":
        return INT4 if head_dim % 2 == 0 else torch.int8
    return torch.int8 if cfg.digest_dtype == "int8" else dtype


def _device_blocks(cfg: KVTierConfig, slot_bytes: int, num_layers: int) -> int:
    if cfg.device_bytes is None:
        return cfg.device_tokens // cfg.block_tokens
    per = slot_bytes * num_layers * cfg.max_sequences
    device_blocks = cfg.device_bytes // per
    if device_blocks < 1:
        raise ValueError(f"device_bytes must hold at least one block per layer and sequence "
                         f"(>= {per} bytes for this model and max_sequences); got {cfg.device_bytes}")
    return device_blocks
