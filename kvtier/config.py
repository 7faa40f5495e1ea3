"""KVTierConfig: every knob of a kvtier store in one frozen, validated dataclass.

Sizes carry their unit in the name (``*_tokens``, ``*_bytes``). String choices are ``Literal``s and
are checked at construction: bad input raises ``ValueError`` naming the field and the allowed
values. Checks that need the filesystem (is ``disk_path`` writable?) or the model shape (does
``hot_bytes`` hold one block?) happen when the store is built.
"""
from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, get_args

Order = Literal["compress-then-tier", "tier-then-compress"]
Policy = Literal["lru", "sink-window", "h2o", "snapkv"]
Attention = Literal["dense", "sparse"]
SelectScore = Literal["centroid", "quest"]
Axis = Literal["channel", "token"]
Durability = Literal["never", "close", "batch"]
DType = Literal["float16", "bfloat16", "float32"]
ByteStageName = Literal["lz4", "zstd", "none"]

#: Codec names known to ``kvtier.compress.get_codec`` (kept here so a config is checked before
#: any codec module is imported).
CODECS = ("fp16", "bf16", "int8", "int4", "int2", "nf4", "fp4", "dyn8")
#: Codecs that reproduce their input exactly (for a matching dtype).
LOSSLESS_CODECS = ("fp16", "bf16")


def lossless_codec(dtype: str | None) -> str:
    """The 16-bit full-precision codec of KV dtype ``dtype`` (a ``KVTierConfig.dtype`` name;
    None: not known yet, fp16). fp16 <-> bf16 would not be lossless, so it follows the dtype."""
    return "bf16" if dtype == "bfloat16" else "fp16"


def _choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")


@dataclass(frozen=True)
class KVTierConfig:
    """Configuration of a tiered KV store (L1 device pool, L2 DRAM ring, L3 SSD segments)."""

    block_tokens: int = 64
    """Tokens per block: the unit of eviction, swap and compression."""

    hot_tokens: Optional[int] = 512
    """L1 budget per sequence and layer, in tokens (rounded down to whole blocks; the open block
    counts). Ignored when ``hot_bytes`` is set."""

    hot_bytes: Optional[int] = None
    """Alternative L1 budget: total bytes of the device pool across all layers and
    ``max_sequences`` sequences; the per-sequence budget is derived from the model shape."""

    max_sequences: int = 4
    """Concurrent sequences the L1 pool is sized for (each gets the full ``hot_tokens`` budget)."""

    host_bytes: int = 256 << 20
    """L2 capacity: bytes of the DRAM ring buffer."""

    disk_path: Optional[str] = None
    """Directory of the L3 segment files; ``None`` means no L3 (L2 is the last tier)."""

    disk_bytes: int = 64 << 30
    """L3 capacity in bytes."""

    disk_segment_bytes: int = 64 << 20
    """Size of one L3 segment file."""

    codec: str = "int4"
    """Codec of the tiers below L1 (see ``order``): one of ``CODECS``."""

    order: Order = "compress-then-tier"
    """``compress-then-tier``: quantize on L1->L2, L2 and L3 hold ``codec`` records.
    ``tier-then-compress``: L2 holds full precision (``fp16``/``bf16``), quantize on the L2->L3 spill."""

    host_codec: Optional[str] = None
    """Per-tier override of the L2 codec; by default filled from ``order``."""

    disk_codec: Optional[str] = None
    """Per-tier override of the L3 codec; by default ``codec``."""

    group_size: int = 32
    """Quantization group size (elements sharing one scale/zero)."""

    key_axis: Axis = "channel"
    """Grouping axis for keys (KIVI: per channel)."""

    value_axis: Axis = "token"
    """Grouping axis for values (KIVI: per token)."""

    policy: Policy = "h2o"
    """Eviction policy: ``lru``, ``sink-window`` (StreamingLLM), ``h2o`` (accumulated attention
    mass), ``snapkv`` (importance observed at the end of prefill)."""

    sink_tokens: Optional[int] = None
    """Leading tokens always kept and always attended (rounded up to blocks). Default: one block
    when the budget has room for it, else 0."""

    window_tokens: Optional[int] = None
    """Recent sealed tokens (before the open block) always kept and attended (rounded up to blocks).
    Default: up to two blocks, as far as the budget allows."""

    snapkv_observe_steps: int = 1
    """``snapkv``: number of ``observe`` calls (from the end of prefill on) whose attention mass
    forms the frozen importance score."""

    high_watermark: float = 0.9
    """Eviction starts when L1 blocks of a sequence-layer reach this fraction of its budget."""

    low_watermark: float = 0.75
    """Eviction frees down to this fraction of the budget."""

    evict_batch_blocks: int = 16
    """Blocks the swap-out worker encodes and writes to L2 per batch."""

    attention: Attention = "dense"
    """``dense``: every token every step; ``sparse``: sinks + window + top-k blocks by key digest
    (digests are kept only in sparse mode, on the L1 device, and counted in its bytes)."""

    budget_tokens: Optional[int] = None
    """Sparse mode: tokens attended per step (open block included); at most ``hot_tokens``.
    Default: ``hot_tokens``."""

    select_score: SelectScore = "centroid"
    """Sparse mode: how blocks are ranked against the query. ``centroid``: q.mean(keys of the
    block), softmax-normalised over the candidate blocks per head, best head wins (ArkVale's
    centre; one dominant head, e.g. an induction head, can claim a block). ``quest``: Quest's
    upper bound sum_d max(q_d*min_d, q_d*max_d), summed over heads. On SmolLM2 at 2k context
    with a 10% budget the centroid kept the recall probe at the reference's accuracy where the
    bound lost half of it (kvtier eval). The digest kept per sealed block and kv head is what the
    score reads, in the KV dtype: the mean (``head_dim`` values) or max | min (``2 * head_dim``)."""

    digest_tokens: Optional[int] = None
    """``centroid`` only: tokens summarised by one key centroid; a block's score is its best
    sub-block's. A divisor of ``block_tokens``; default ``block_tokens`` (one centroid per block).
    One key that matches the query stands out of the mean of 4 keys, not of 16: on SmolLM2 at 4k
    context, int4, 16-token blocks and a 10% budget, the recall probe (8 windows) kept 0.92 of the
    reference's accuracy with 4-token centroids against 0.65 with one centroid per block, at
    ``block_tokens / digest_tokens`` times the digest bytes (1/8 of a 16-bit KV cache at 4 tokens)."""

    prefetch: bool | Literal["auto"] = "auto"
    """Asynchronously decode blocks predicted to be needed (last selection, next layer), on a
    background thread. ``"auto"``: on when the store's device is a GPU, off on a CPU store. On a
    CPU host the prefetch thread decodes with the same cores, and holds the GIL while it does,
    that the decode step needs: bench_store at 8k context, L1 25%, sparse, int4 (2 cores), the
    store overhead went from 0.28 of the reference step without it to 0.35 with it (select
    waits for the GIL), and at 4k, where nothing misses, 0.21 -> 0.22. ``True`` forces it on."""

    prefetch_blocks: int = 64
    """Bound on decoded blocks held in the prefetch buffer."""

    durability: Durability = "never"
    """L3 durability: ``never`` (left to the OS: a clean ``close`` leaves the records readable by
    the next process, a machine crash may lose recent ones), ``close`` (fdatasync on sync/close), ``batch`` (fdatasync after every spilled batch)."""

    lz4_min_saving: float = 0.05
    """The byte stage's output (lz4 or zstd, see ``byte_stage``) is kept only when it saves at least
    this fraction of the record; otherwise the record is stored raw."""

    byte_stage: ByteStageName = "lz4"
    """Lossless stage on encoded records on their way to L3: ``lz4`` (fast; saves nothing on
    quantized records, which are then stored raw), ``zstd`` (entropy coded: about 5% off int4
    records of real KV, so lower ``lz4_min_saving`` to ~0.02 with it; ~10 us more per swap-in of
    a 64-token block) or ``none``."""

    byte_stage_l2: bool = False
    """Also pass L2 (DRAM) records through ``byte_stage``: fewer host bytes, one decompression per
    L2 swap-in. An L2 record spills to L3 as it is (no second pass)."""

    dtype: Optional[DType] = None
    """KV dtype; ``None`` means the model's."""

    remote_url: Optional[str] = None
    """L4: ``redis://host:port/db`` (or ``rediss://``, ``unix:///path.sock?db=N``) of a Redis/Valkey
    server shared by many processes. Content-addressed blocks (sequences whose token ids the store
    was given) are published there asynchronously and L1/L2/L3 misses fall back to it; a dead
    server is a miss, never an error. ``None``: no L4."""

    remote_key_prefix: str = "kvtier:"
    """Namespace of this store's keys on the L4 server."""

    write_through: bool = True
    """Content-addressed blocks (token ids known) are written to L3 and L4 as they seal, off the
    decode path, so other sequences, later processes and other hosts find them. ``False``: blocks
    reach L3 only by eviction and L4 not at all; no extra copy is kept (the footprint of tiering
    alone, as ``kvtier eval`` measures it)."""

    def __post_init__(self) -> None:
        _positive_int("block_tokens", self.block_tokens)
        if self.hot_bytes is None:
            if self.hot_tokens is None:
                raise ValueError("hot_tokens or hot_bytes must be set (hot_tokens: int >= block_tokens)")
            _positive_int("hot_tokens", self.hot_tokens)
            if self.hot_tokens < self.block_tokens:
                raise ValueError(
                    f"hot_tokens must be >= block_tokens ({self.block_tokens}); got {self.hot_tokens}")
        else:
            _positive_int("hot_bytes", self.hot_bytes)
        _positive_int("max_sequences", self.max_sequences)
        _positive_int("host_bytes", self.host_bytes)
        _positive_int("disk_bytes", self.disk_bytes)
        _positive_int("disk_segment_bytes", self.disk_segment_bytes, minimum=4096)
        if self.disk_bytes < self.disk_segment_bytes:
            raise ValueError(f"disk_bytes must be >= disk_segment_bytes ({self.disk_segment_bytes}); "
                             f"got {self.disk_bytes}")
        if self.disk_path is not None and (not isinstance(self.disk_path, (str, Path)) or str(self.disk_path) == ""):
            raise ValueError(f"disk_path must be a non-empty path or None; got {self.disk_path!r}")
        if isinstance(self.disk_path, Path):
            object.__setattr__(self, "disk_path", str(self.disk_path))
        _choice("codec", self.codec, CODECS)
        _choice("order", self.order, get_args(Order))
        if self.host_codec is None:
            object.__setattr__(self, "host_codec", self.codec if self.order == "compress-then-tier"
                               else lossless_codec(self.dtype))
        if self.disk_codec is None:
            object.__setattr__(self, "disk_codec", self.codec)
        _choice("host_codec", self.host_codec, CODECS)
        _choice("disk_codec", self.disk_codec, CODECS)
        _positive_int("group_size", self.group_size)
        _choice("key_axis", self.key_axis, get_args(Axis))
        _choice("value_axis", self.value_axis, get_args(Axis))
        _choice("policy", self.policy, get_args(Policy))
        _choice("attention", self.attention, get_args(Attention))
        _choice("select_score", self.select_score, get_args(SelectScore))
        if self.digest_tokens is None:
            object.__setattr__(self, "digest_tokens", self.block_tokens)
        _positive_int("digest_tokens", self.digest_tokens)
        if self.block_tokens % self.digest_tokens:
            raise ValueError(f"digest_tokens must divide block_tokens ({self.block_tokens}); "
                             f"got {self.digest_tokens}")
        if self.select_score != "centroid" and self.digest_tokens != self.block_tokens:
            raise ValueError(f"digest_tokens must equal block_tokens ({self.block_tokens}) unless "
                             f"select_score is 'centroid'; got {self.digest_tokens}")
        _choice("durability", self.durability, get_args(Durability))
        if self.dtype is not None:
            _choice("dtype", self.dtype, get_args(DType))
        if self.remote_url is not None:
            from kvtier.tiers.remote import check_url  # imports no client: the URL is parsed only
            try:
                check_url(self.remote_url)
            except ValueError as e:
                raise ValueError(f"remote_url must be a Redis URL or None; {e}") from None
        if not isinstance(self.remote_key_prefix, str) or "\x00" in self.remote_key_prefix \
                or len(self.remote_key_prefix.encode()) > 128:
            raise ValueError(f"remote_key_prefix must be a str of at most 128 UTF-8 bytes without NUL; "
                             f"got {self.remote_key_prefix!r:.80}")
        _positive_int("snapkv_observe_steps", self.snapkv_observe_steps)
        _positive_int("evict_batch_blocks", self.evict_batch_blocks)
        _positive_int("prefetch_blocks", self.prefetch_blocks)
        if not (isinstance(self.prefetch, bool) or self.prefetch == "auto"):
            raise ValueError(f"prefetch must be True, False or 'auto'; got {self.prefetch!r}")
        for name in ("high_watermark", "low_watermark"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must be a float in (0, 1]; got {v!r}")
        if self.low_watermark > self.high_watermark:
            raise ValueError(
                f"low_watermark must be <= high_watermark ({self.high_watermark}); got {self.low_watermark}")
        _choice("byte_stage", self.byte_stage, get_args(ByteStageName))
        if not isinstance(self.byte_stage_l2, bool):
            raise ValueError(f"byte_stage_l2 must be True or False; got {self.byte_stage_l2!r}")
        if isinstance(self.lz4_min_saving, bool) or not isinstance(self.lz4_min_saving, (int, float)) \
                or not 0.0 <= self.lz4_min_saving < 1.0:
            raise ValueError(f"lz4_min_saving must be a float in [0, 1); got {self.lz4_min_saving!r}")

        bt = self.block_tokens
        # The sparse budget and its fixed parts are only known in tokens when hot_tokens is.
        hot = self.hot_tokens if self.hot_bytes is None else None
        if self.budget_tokens is None:
            if hot is not None:
                object.__setattr__(self, "budget_tokens", (hot // bt) * bt)
        else:
            _positive_int("budget_tokens", self.budget_tokens)
            if self.budget_tokens < bt:
                raise ValueError(f"budget_tokens must be >= block_tokens ({bt}); got {self.budget_tokens}")
            if hot is not None and self.budget_tokens > hot:
                raise ValueError(
                    f"budget_tokens must be <= hot_tokens ({hot}): the attended blocks are resident "
                    f"in L1 while attention runs; got {self.budget_tokens}")
        budget = self.budget_tokens
        if self.sink_tokens is not None:
            _positive_int("sink_tokens", self.sink_tokens, minimum=0)
        if self.window_tokens is not None:
            _positive_int("window_tokens", self.window_tokens, minimum=0)
        if budget is None:
            # hot_bytes without budget_tokens: the store fills the defaults once it knows the budget
            return
        sink, window = self.sink_window(budget)
        object.__setattr__(self, "sink_tokens", sink)
        object.__setattr__(self, "window_tokens", window)
        fixed = _round_up(self.sink_tokens, bt) + _round_up(self.window_tokens, bt) + bt
        if budget < fixed:
            raise ValueError(
                f"budget_tokens must be >= sink_tokens + window_tokens + one open block "
                f"(= {fixed} with block_tokens={bt}); got {budget}")

    # -- derived sizes ------------------------------------------------------------------------

    def sink_window(self, budget_tokens: int) -> tuple[int, int]:
        """(sink_tokens, window_tokens) for a sparse budget: the configured values, or the
        defaults (one sink block if the budget has room for it, then up to two window blocks)."""
        bt = self.block_tokens
        sink = self.sink_tokens
        if sink is None:
            sink = bt if budget_tokens >= 2 * bt else 0
        window = self.window_tokens
        if window is None:
            room = max(0, budget_tokens - bt - _round_up(sink, bt))
            window = min(2 * bt, (room // bt) * bt)
        return sink, window

    # -- (de)serialisation --------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-serialisable (derived defaults filled in)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "KVTierConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown KVTierConfig field(s) {unknown}; allowed: {sorted(names)}")
        return cls(**data)

    @classmethod
    def from_toml(cls, path: str | Path) -> "KVTierConfig":
        """Load from a TOML file: fields at top level or under a ``[kvtier]`` table."""
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
        if "kvtier" in data and isinstance(data["kvtier"], dict):
            data = data["kvtier"]
        return cls.from_dict(data)


def _round_up(x: int, m: int) -> int:
    return int(math.ceil(x / m)) * m if x else 0


__all__ = ["KVTierConfig", "CODECS", "LOSSLESS_CODECS", "lossless_codec"]
