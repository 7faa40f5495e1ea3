"""KVTierConfig: every knob of a kvtier store in one frozen, validated dataclass.

Sizes carry their unit in the name (``*_tokens``, ``*_bytes``). String choices are ``Literal``s and
every field is checked at construction (types too: a bool is a bool): bad input raises
``ValueError`` naming the field and the allowed values. What each field allows on its own is
declared in ``kvtier.configcheck``; how fields fit together is checked here. Checks that need the
model shape (does ``host_bytes`` hold one block? does L1 fit the device?) are
``kvtier.store.sizing.check_model``, run by the store before it allocates anything; those that
need the filesystem (is ``disk_path`` writable?) happen when L3 is opened.

Derived fields (``DERIVED_FIELDS``: ``host_codec``, ``budget_tokens``, ...) hold a value marked
as computed, so that ``dataclasses.replace`` and ``from_dict(to_dict() | {...})`` compute them
again from what the user set instead of pinning the old ones.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from kvtier.configcheck import (
    CODECS, GROUP_SIZES, MAX_KEY_OUTLIERS, MAX_TOKENS, MIN_SEGMENT_BYTES, PRECISION_CODECS,
    RENAMED_FIELDS, Derived, round_up, check_fields, check_importance, check_int, check_remote_url,
    check_sparse_budget, check_whole_blocks, derive, plain, read_toml, renamed_fields,
)
from kvtier.configdoc import class_doc, field_docs

Order = Literal["compress-then-tier", "tier-then-compress"]
Policy = Literal["lru", "sink-window", "h2o", "snapkv"]
Attention = Literal["dense", "sparse"]
SelectScore = Literal["centroid", "quest"]
SelectHeads = Literal["shared", "per_head"]
DigestDType = Literal["int8", "int4", "kv"]
RestAttention = Literal["estimate", "drop"]
AttentionMath = Literal["float32", "sdpa"]
Axis = Literal["channel", "token"]
Durability = Literal["never", "close", "batch"]
DiskEviction = Literal["lru", "lfu", "none"]
DiskAdmission = Literal["always", "second-touch"]
DType = Literal["float16", "bfloat16", "float32"]
ByteStageName = Literal["lz4", "zstd", "none"]
Precision = Literal["fixed", "importance"]
RecallReference = Literal["median", "mean", "all-mean"]
Int8ZeroPoint = Literal["none", "key", "value", "both"]
KeyTransform = Literal["none", "hadamard"]

#: The 16-bit pass-through codecs: exact for KV of their own dtype only (float32 KV is rounded to
#: 16 bits by them), so a 16-bit tier codec follows the KV dtype. ``fp32`` is exact for every
#: KV dtype and follows nothing.
LOSSLESS_CODECS = ("fp16", "bf16")
#: Fields computed from the others unless the user sets them.
DERIVED_FIELDS = ("block_tokens", "host_codec", "disk_codec", "digest_tokens", "digest_dtype", "rest_attention",
                  "value_digest_tokens", "budget_tokens", "sink_tokens", "window_tokens",
                  "disk_segment_bytes")
#: Segment size when ``disk_bytes`` leaves room for two of them (else half of ``disk_bytes``).
DEFAULT_SEGMENT_BYTES = 64 << 20

#: ``block_tokens`` by attention mode when the user sets none (see ``KVTierConfig.block_tokens``).
DEFAULT_BLOCK_TOKENS = {"dense": 64, "sparse": 16}


#: ``digest_tokens`` of the centroid score when the user sets none (see ``KVTierConfig.digest_tokens``).
DEFAULT_DIGEST_TOKENS = 1
#: ``value_digest_tokens`` when the user sets none and it fits (see ``KVTierConfig.value_digest_tokens``).
DEFAULT_VALUE_DIGEST_TOKENS = 4


def default_block_tokens(attention: str) -> int:
    """The block size a config with ``attention`` (``"dense"``/``"sparse"``) gets by default."""
    return DEFAULT_BLOCK_TOKENS[attention]


def lossless_codec(dtype: str | None) -> str:
    """The full-precision codec of KV dtype ``dtype`` (a ``KVTierConfig.dtype`` name; None: not
    known yet, fp16): fp16 <-> bf16 would not be lossless, and float32 KV needs ``fp32``."""
    return "bf16" if dtype == "bfloat16" else "fp32" if dtype == "float32" else "fp16"


@dataclass(frozen=True)
class KVTierConfig:
    """Configuration of a tiered KV store (L1 device pool, L2 DRAM ring, L3 SSD segments)."""

    block_tokens: Optional[int] = None
    """Tokens per block: the unit of eviction, swap, compression and (sparse mode) selection.
    Default (derived, see ``default_block_tokens``): 64 for ``attention="dense"``, where every
    step swaps in every block outside L1 and the per-block cost dominates; 16 for ``"sparse"``,
    where a block is what a step selects and smaller blocks leave a small budget room to select
    (why: docs/results/config-defaults.md#block_tokens)."""

    device_tokens: Optional[int] = 512
    """L1 budget per sequence and layer, in tokens: a whole number of blocks (the open block
    counts). Ignored when ``device_bytes`` is set."""

    device_bytes: Optional[int] = None
    """Alternative L1 budget: total bytes of the device pool across all layers and
    ``max_sequences`` sequences; the per-sequence budget is derived from the model shape (a pool
    grown for more sequences gives each the same)."""

    max_sequences: int = 4
    """Concurrent sequences the L1 pool is sized for when the store opens (each gets the full
    ``device_tokens`` budget). More live sequences (beams, ``num_return_sequences``, forks, other open
    caches) grow the pool on demand, doubling its sequences, up to ``device_max_bytes``."""

    device_max_bytes: Optional[int] = None
    """Most bytes the L1 pool may grow to as live sequences outnumber ``max_sequences``. None:
    bounded by the device's memory only (a growth it cannot hold raises MemoryError naming the
    bytes)."""

    host_bytes: int = 256 << 20
    """L2 capacity: bytes of the DRAM ring buffer. At least 4096 and at most the machine's RAM;
    at attach, at least one encoded block of the model (the error says how many bytes)."""

    host_overflow_bytes: int = 0
    """Bytes of blocks L2 may keep beyond ``host_bytes`` while L3 refuses them (its disk is
    full): held as owned copies and spilled again once L3 takes records, shown in
    ``stats()["l2"]["overflow_*"]``; past it, a full L1 and L2 raise the disk-full error.
    0 (the default) raises it once the ring is full."""

    disk_path: Optional[str] = None
    """Directory of the L3 segment files; ``None`` means no L3 (L2 is the last tier)."""

    disk_bytes: int = 64 << 30
    """L3 capacity in bytes; with ``disk_path`` set, at least two segments (L3 frees space by
    compacting one segment into another)."""

    disk_segment_bytes: Optional[int] = None
    """Size of one L3 segment file, in [4096, 2**32); at attach, at least one encoded block.
    Default (derived): 64 MiB, or half of ``disk_bytes`` (whole pages) when that is smaller, so
    that L3 always has the two segments compaction needs."""

    disk_max_age_s: Optional[float] = None
    """Kept L3 records (content-addressed blocks no live sequence uses, left for reuse after a
    restart) older than this many seconds are deleted when a store opens ``disk_path``;
    ``None`` keeps them (until ``disk_bytes`` is reached)."""

    disk_kept_bytes: Optional[int] = None
    """The most bytes of kept L3 records left when a store opens ``disk_path`` (the oldest go
    first); ``None``: only ``disk_bytes`` bounds them."""

    disk_eviction: DiskEviction = "lfu"
    """What a full L3 does: ``lfu`` / ``lru`` evict records no live sequence uses and no pin
    keeps (``kvtier cache pin``), least often / least recently used first, once the live
    records near ``disk_bytes`` (two segments below it); ``none`` refuses new records instead
    (then a store deletes every unused record at once to make room). docs/operations.md."""

    disk_admission: DiskAdmission = "always"
    """Which published blocks L3 writes: ``always``; ``second-touch``: a block only when it is
    offered a second time (seen again before its name leaves a list of recent refusals), so
    one-off prompts cost no SSD writes, but a prompt seen once is not found after a restart.
    Spilled blocks of live sequences are always written. docs/operations.md."""

    codec: str = "int4"
    """Codec of the tiers below L1 (see ``order``): one of ``CODECS``."""

    key_codec: Optional[str] = None
    """Codec of the keys wherever a tier stores ``codec`` (None: ``codec``), e.g. ``int4`` keys with
    ``value_codec="int2"`` values (K4V2: keys carry the attention pattern and lose more per bit), or ``int8``
    keys with ``int4`` values (K8V4), which copied more long exact answers than int4 on one set of
    samples and none more on another (docs/results/long-answers.md). One of ``CODECS`` except the
    16-bit pass-through ones; ``precision="importance"`` needs None."""

    value_codec: Optional[str] = None
    """Codec of the values wherever a tier stores ``codec`` (None: ``codec``); as ``key_codec``."""

    key_transform: KeyTransform = "none"
    """``hadamard``: integer-coded keys are multiplied by an orthonormal Hadamard matrix (per token,
    over head_dim) before quantizing and again after dequantizing, spreading the few wide channels
    over all (QuaRot/RotateKV); ``none``: keys are quantized as they are. Part of the codec's identity."""

    order: Order = "compress-then-tier"
    """``compress-then-tier``: quantize on L1->L2, L2 and L3 hold ``codec`` records.
    ``tier-then-compress``: L2 holds full precision (``fp16``/``bf16``, ``fp32`` with ``dtype="float32"``),
    quantize on the L2->L3 spill."""

    host_codec: Optional[str] = None
    """Per-tier override of the L2 codec; by default derived from ``order`` (``codec``, or the
    full-precision codec of ``dtype`` for ``tier-then-compress``). A derived value is computed
    again whenever the config is rebuilt (``dataclasses.replace``, ``from_dict``); ``to_dict``
    gives it as ``None``. The same holds for every field of ``DERIVED_FIELDS``."""

    disk_codec: Optional[str] = None
    """Per-tier override of the L3 codec; by default (derived) ``codec``."""

    group_size: int = 32
    """Quantization group size (elements sharing one scale/zero): 32, 64 or 128."""

    precision: Precision = "fixed"
    """``fixed``: every block below L1 is stored in its tier's codec. ``importance``: a block's codec
    is chosen at eviction by how its attention mass ranks among its (sequence, layer)'s sealed blocks:
    the heaviest ``heavy_fraction`` in ``heavy_codec``, the lightest ``cold_fraction`` in ``cold_codec``,
    the rest in ``codec``; a low block that turns heavy (``recall_mass``) is read from a ``codec`` copy in
    L3. Needs ``policy`` h2o/snapkv, ``order="compress-then-tier"``, integer codecs (docs/configuration.md#details)."""

    heavy_codec: str = "int8"
    """``precision="importance"``: codec of the heaviest blocks; one of ``PRECISION_CODECS`` with
    at least ``codec``'s bits."""

    cold_codec: str = "int2"
    """``precision="importance"``: codec of the lightest blocks; one of ``PRECISION_CODECS`` with
    at most ``codec``'s bits."""

    heavy_fraction: float = 0.1
    """``precision="importance"``: fraction (by rank, in [0, 1]) of a table's sealed blocks whose
    statistic makes them heavy."""

    cold_fraction: float = 0.5
    """``precision="importance"``: fraction (by rank, in [0, 1], at most ``1 - heavy_fraction``)
    of a table's sealed blocks whose statistic makes them cold."""

    cold_key_outliers: Optional[int] = None
    """``precision="importance"``: key channels of each block and KV head that ``cold_codec`` records
    keep exactly (``key_axis="channel"``; 0 to 32, at most ``head_dim``), so the cold level may be cheaper
    than that codec at fixed precision. None: as that codec keeps at fixed precision
    (``int2_key_outliers`` for int2). Only where ``cold_codec`` differs from ``codec``. Default None:
    no cheaper cold level measured better (docs/results/config-defaults.md#cold_key_outliers)."""

    recall_mass: float = 2.0
    """``precision="importance"``: a block stored below ``codec`` whose mass in one observation
    reaches this multiple of that observation's ``recall_reference`` is read from its ``codec``
    copy from then on (> 0; ``math.inf``: never, and no ``codec`` copies are written to L3)."""

    recall_reference: RecallReference = "median"
    """``precision="importance"``: what a block's mass in one observation is compared with for
    ``recall_mass``. ``median`` / ``mean``: the median / mean mass of that observation's blocks
    outside the sink blocks, the recent window and the open block (those take most of every
    observation's mass, and are never stored below L1 in the first place); ``all-mean``: the
    mean over every observed block, those included."""

    key_axis: Axis = "channel"
    """Grouping axis for keys (KIVI: per channel)."""

    value_axis: Axis = "token"
    """Grouping axis for values (KIVI: per token)."""

    int2_key_outliers: int = 8
    """Key channels of each block and KV head that ``int2`` key records (``key_axis="channel"``) also
    keep exactly, in the KV dtype with a one-byte index each: the widest-range channels of the block,
    where 2-bit codes lose most. 0 to 32 (at most ``head_dim``); 0: plain int2; other codecs ignore it.
    Costs ``n * (2 * block_tokens + 1)`` bytes per block and KV head (16-bit dtype). Default: the count
    that beat none on every text (docs/results/config-defaults.md#int2_key_outliers)."""

    int8_zero_point: Int8ZeroPoint = "both"
    """Which roles' ``int8`` records are asymmetric (uint8 codes over each group's [min, max], one
    16-bit zero per group) instead of symmetric (int8 codes over [-absmax, absmax]): ``none``, ``key``,
    ``value`` or ``both``; other codecs ignore it. Post-RoPE keys often sit off zero, where a symmetric
    range wastes codes. Records of either form decode under any setting. Default ``both`` (with
    ``int8_value_axis="channel"``): the best measured (docs/results/config-defaults.md#int8_zero_point)."""

    int8_value_axis: Optional[Axis] = "channel"
    """Grouping axis of ``int8`` values: ``channel`` (one scale and zero per channel per group of
    tokens, as keys have), ``token``, or None for ``value_axis``; other codecs use ``value_axis``.
    Same bytes either way; records of either axis decode under any setting. Default ``channel`` (with
    ``int8_zero_point="both"``): the best setting measured through the store in bf16
    (docs/results/config-defaults.md#int8_value_axis)."""

    policy: Policy = "h2o"
    """Eviction policy: ``lru``, ``sink-window`` (StreamingLLM), ``h2o`` (accumulated attention
    mass), ``snapkv`` (importance observed at the end of prefill)."""

    sink_tokens: Optional[int] = None
    """Leading tokens always kept and always attended: a whole number of blocks. Default: one block
    when the budget has room for it, else 0."""

    window_tokens: Optional[int] = None
    """Recent sealed tokens (before the open block) always kept and attended: a whole number of
    blocks. Default: up to two blocks, at most half of the budget left after the sink and open blocks
    (the rest is selected by query; see ``sink_window``)."""

    snapkv_observe_steps: int = 1
    """``snapkv``: number of ``observe`` calls (from the end of prefill on) whose attention mass
    forms the frozen importance score."""

    high_watermark: float = 0.9
    """Eviction starts when L1 blocks of a sequence-layer reach this fraction of its budget."""

    low_watermark: float = 0.75
    """Eviction chooses victims down to this fraction of the budget, blocks no read of the step
    used first: one that needs a write is written below L1 and freed; one with a valid copy below
    stays resident until its slot is wanted (then freed without a write)."""

    evict_batch_blocks: int = 16
    """Blocks the swap-out worker encodes and writes to L2 per batch."""

    attention: Attention = "dense"
    """``dense``: every token every step; ``sparse``: sinks + window + top-k blocks by key digest
    (digests are kept only in sparse mode, on the L1 device, and counted in its bytes)."""

    budget_tokens: Optional[int] = None
    """Sparse mode: tokens attended per step (open block included): a whole number of blocks, at
    most ``device_tokens``. Default: ``device_tokens``."""

    select_score: SelectScore = "centroid"
    """Sparse mode: how blocks are ranked against the query, from the digest kept per sealed block
    and kv head (stored as ``digest_dtype`` says). ``centroid``: q.mean(keys of each ``digest_tokens``
    sub-block), softmax-normalised over candidate blocks per head, best head wins (ArkVale). ``quest``:
    Quest's bound sum_d max(q_d*min_d, q_d*max_d) over a max | min digest, summed over heads. Default
    ``centroid``: the better recall measured (docs/results/config-defaults.md#select_score)."""

    select_heads: SelectHeads = "per_head"
    """Sparse mode: whose ranking picks the query-chosen blocks. ``per_head`` (default): each kv head ranks on
    its own scores and the slots go round-robin over the heads (each head's next best block not yet taken),
    so a block one head needs is not lost to another's favourites; the better recall at small budgets
    (docs/results/config-defaults.md#select_heads). ``shared``: one ranking per layer, the kv heads' scores
    folded (see ``select_score``). Every head attends the union; nothing stored changes."""

    select_stickiness: float = 0.0
    """Sparse mode: how much the ranking prefers blocks already in L1: a resident candidate's score counts
    ``1 + select_stickiness`` times (``s + select_stickiness * |s|`` for quest's signed bounds), so near-ties
    at the end of the top-k stop trading places each step, each trade a swap-in (an L2 read and a decode).
    ``0`` (default): the ranking alone, the better recall measured
    (docs/results/config-defaults.md#select_stickiness). Nothing stored changes."""

    digest_tokens: Optional[int] = None
    """``centroid`` only: tokens summarised by one key centroid; a block's score is its best sub-block's. A
    divisor of ``block_tokens``; default (derived) 1: the keys themselves (4-bit per channel with the default
    ``digest_dtype``); ``block_tokens`` with ``quest``. Costs ``block_tokens / digest_tokens`` rows per block and kv
    head in L1 (see ``digest_dtype``), each read every step; 2 (means of key pairs, half the rows) lets long exact
    answers drift (docs/results/long-answers.md). Why 1: docs/results/config-defaults.md#digest_tokens."""

    digest_dtype: Optional[DigestDType] = None
    """How the digests are stored in L1. ``int4`` (``centroid`` with ``digest_tokens < block_tokens``): a block's key
    rows as 4-bit codes per channel against each channel's min and max over the block (float16 scale and zero), 48
    bytes a row at ``head_dim`` 64; value means stay int8. ``int8``: a row's codes against its absmax, a float32 scale
    (``head_dim + 4`` bytes). ``kv``: the KV dtype. Default (derived) ``int4`` where it applies, else ``int8``: the
    same long answers as int8 for 22% fewer L1 bytes (docs/results/config-defaults.md#digest_dtype)."""

    rest_attention: Optional[RestAttention] = None
    """Sparse mode: what a step makes of the candidate blocks it does not select. ``estimate`` (default with
    ``centroid``): attends them approximately, each key centroid a key standing for the ``digest_tokens`` tokens it
    averages, valued by the mean of its ``value_digest_tokens`` values (kept in the digest), merged with the exact
    attention over the selected blocks by log-sum-exp. ``drop`` (default with ``quest``, which keeps no centroids):
    the selected blocks alone. Why ``estimate``: docs/results/config-defaults.md#rest_attention."""

    value_digest_tokens: Optional[int] = None
    """``rest_attention="estimate"`` only: tokens whose values one mean of the digest stands for; a multiple of
    ``digest_tokens`` that divides ``block_tokens``. Default (derived): the largest such up to 4, else ``digest_tokens``.
    Costs ``block_tokens / value_digest_tokens`` rows per block and kv head in L1, stored as ``digest_dtype`` says."""

    attention_math: AttentionMath = "sdpa"
    """How kvtier's own attention computes where it replaces the model's (sparse decode, and multi-token
    steps over cached tokens, e.g. a chat's next turn). ``sdpa`` (default): the model's own attention on
    the gathered K/V, its mask and scale: with lossless codecs and a budget covering the context, tokens equal
    ``DynamicCache``'s (a step whose selection leaves blocks out takes CPU flash attention). ``float32``:
    wider sums, rounded once: nearer float64; tokens can part from DynamicCache's (configuration.md#details)."""

    prefetch: bool | Literal["auto"] = "auto"
    """Asynchronously decode blocks predicted to be needed (last selection, next layer), on a
    background thread. ``"auto"``: on when the store's device is a GPU, off on a CPU store, where the
    thread competes for the cores and the GIL the decode step needs and made steps slower
    (docs/results/config-defaults.md#prefetch). ``True`` forces it on."""

    prefetch_blocks: int = 64
    """Bound on decoded blocks held in the prefetch buffer."""

    durability: Durability = "never"
    """L3 durability: ``never`` (left to the OS: a clean ``close`` leaves the records readable by
    the next process, a machine crash may lose recent ones), ``close`` (fdatasync on sync/close), ``batch`` (fdatasync after every spilled batch)."""

    byte_stage_min_saving: float = 0.05
    """The byte stage's output (lz4 or zstd, see ``byte_stage``) is kept only when it saves at least
    this fraction of the record; otherwise the record is stored raw."""

    byte_stage: ByteStageName = "lz4"
    """Lossless stage on encoded records on their way to L3: ``lz4`` (fast; saves nothing on
    quantized records, which are then stored raw), ``zstd`` (entropy coded: saves a few percent of int4
    records for some time per swap-in, so lower ``byte_stage_min_saving`` with it;
    docs/results/config-defaults.md#byte_stage) or ``none``."""

    byte_stage_l2: bool = False
    """Also pass L2 (DRAM) records through ``byte_stage``: fewer host bytes, one decompression per
    L2 swap-in. An L2 record spills to L3 as it is (no second pass)."""

    dtype: Optional[DType] = None
    """KV dtype; ``None`` means the model's."""

    remote_url: Optional[str] = None
    """L4: ``redis://host:port/db`` (or ``rediss://``, ``unix:///path.sock?db=N``) of a Redis/Valkey
    server, or ``mooncake://host:rpc_port?metadata=http://host:port/metadata`` of a Mooncake Store
    pool (docs/mooncake.md), shared by many processes. Content-addressed blocks (sequences whose
    token ids the store was given) are published there asynchronously and L1/L2/L3 misses fall
    back to it; a dead server is a miss, never an error. ``None``: no L4."""

    remote_key_prefix: str = "kvtier:"
    """Prefix of this store's keys on the L4 server (where its byte quota is counted)."""

    namespace: str = ""
    """The deployment (or tenant) this store serves. Folded into the name of every block that
    leaves its sequence (L3 records kept for reuse, L4 keys, prefix sharing), so deployments
    sharing one L3 directory or L4 server never read each other's KV; blocks are reused only
    within a namespace. Per-request isolation inside one deployment is the ``salt`` of
    :func:`kvtier.attach` (vLLM: ``cache_salt``)."""

    write_through: bool = True
    """Content-addressed blocks (token ids known) are written to L3 and L4 as they seal, off the
    decode path, so other sequences, later processes and other hosts find them. ``False``: blocks
    reach L3 only by eviction and L4 not at all; no extra copy is kept (the footprint of tiering
    alone, as ``kvtier eval`` measures it)."""

    def __post_init__(self) -> None:
        # A value this config computed (and not the user) is passed back in by
        # dataclasses.replace and from_dict(to_dict()): forget it and compute it again from what
        # the user set, so that replace(cfg, codec="int8") does not keep the old host_codec.
        for name in DERIVED_FIELDS:
            if isinstance(getattr(self, name), Derived):
                object.__setattr__(self, name, None)
        check_fields(self)  # each field alone, as configcheck declares; then how they fit together
        self._check_l1()
        self._check_tiers()
        self._check_codecs()
        self._check_selection()
        if self.remote_url is not None:
            check_remote_url(self.remote_url)
        if self.low_watermark > self.high_watermark:
            raise ValueError(
                f"low_watermark must be <= high_watermark ({self.high_watermark}); got {self.low_watermark}")
        check_sparse_budget(self)

    # -- checks of __post_init__ across fields, one area each, in the order they run (a derived
    # value is filled before the first check that reads it) --------------------------------------

    def _check_l1(self) -> None:
        """Block size and the L1 budget (``device_tokens`` or ``device_bytes``)."""
        if self.block_tokens is None:
            derive(self, "block_tokens", default_block_tokens(self.attention))
        if self.device_bytes is None:
            if self.device_tokens is None:
                raise ValueError("device_tokens or device_bytes must be set (device_tokens: int >= block_tokens)")
            check_int("device_tokens", self.device_tokens, 1, MAX_TOKENS)
            if self.device_tokens < self.block_tokens:
                raise ValueError(
                    f"device_tokens must be >= block_tokens ({self.block_tokens}); got {self.device_tokens}")
            check_whole_blocks(self, "device_tokens", self.device_tokens, self.block_tokens)

    def _check_tiers(self) -> None:
        """L3 segments within ``disk_bytes``, and the L3 directory."""
        if self.disk_segment_bytes is None:
            half = self.disk_bytes // 2 // 4096 * 4096
            derive(self, "disk_segment_bytes", max(MIN_SEGMENT_BYTES, min(DEFAULT_SEGMENT_BYTES, half)))
        if self.disk_bytes < self.disk_segment_bytes:
            raise ValueError(f"disk_bytes must be >= disk_segment_bytes ({self.disk_segment_bytes:,}); "
                             f"got {self.disk_bytes:,}")
        if self.disk_path is not None:
            if not isinstance(self.disk_path, (str, Path)) or str(self.disk_path).strip() == "" \
                    or "\x00" in str(self.disk_path):
                raise ValueError(f"disk_path must be a non-empty path (without NUL) or None; got {self.disk_path!r}")
            # "~/x" is the user's home, as in a shell, never a folder named "~"
            object.__setattr__(self, "disk_path", os.path.expanduser(str(self.disk_path)))

    def _check_codecs(self) -> None:
        """The codec of each tier (derived ones filled) and mixed precision."""
        if self.host_codec is None:
            derive(self, "host_codec", self.codec if self.order == "compress-then-tier"
                    else lossless_codec(self.dtype))
        if self.disk_codec is None:
            derive(self, "disk_codec", self.codec)
        if self.heavy_fraction + self.cold_fraction > 1.0:
            raise ValueError(f"cold_fraction must be <= 1 - heavy_fraction ({1 - self.heavy_fraction:g}); "
                             f"got {self.cold_fraction!r}")
        check_importance(self)

    def _check_selection(self) -> None:
        """How sparse attention scores blocks (``digest_tokens`` filled here)."""
        if self.digest_tokens is None:
            derive(self, "digest_tokens", self.block_tokens if self.select_score != "centroid"
                    else math.gcd(self.block_tokens, DEFAULT_DIGEST_TOKENS))
        check_int("digest_tokens", self.digest_tokens, 1, self.block_tokens)
        if self.block_tokens % self.digest_tokens:
            raise ValueError(f"digest_tokens must divide block_tokens ({self.block_tokens}); "
                             f"got {self.digest_tokens}")
        if self.select_score != "centroid" and self.digest_tokens != self.block_tokens:
            raise ValueError(f"digest_tokens must equal block_tokens ({self.block_tokens}) unless "
                             f"select_score is 'centroid'; got {self.digest_tokens}")
        if self.digest_dtype is None:
            derive(self, "digest_dtype", "int4" if self.select_score == "centroid"
                   and self.digest_tokens < self.block_tokens else "int8")
        if self.digest_dtype == "int4" and (self.select_score != "centroid" or self.digest_tokens == self.block_tokens):
            # its scale and zero are per channel over a block's centroids: one centroid a block
            # would keep each channel exactly in float16 (more bytes than int8, nothing quantized)
            raise ValueError(f"digest_dtype='int4' needs select_score='centroid' with digest_tokens < "
                             f"block_tokens ({self.block_tokens}); got select_score={self.select_score!r}, "
                             f"digest_tokens={self.digest_tokens}")
        if self.rest_attention is None:
            derive(self, "rest_attention", "estimate" if self.select_score == "centroid" else "drop")
        if self.rest_attention == "estimate" and self.select_score != "centroid":
            raise ValueError(f"rest_attention='estimate' needs select_score='centroid' (the estimate attends "
                             f"the key centroids; quest keeps none); got select_score={self.select_score!r}")
        if self.rest_attention != "estimate":
            if self.value_digest_tokens is not None:
                raise ValueError(f"value_digest_tokens is only for rest_attention='estimate'; got "
                                 f"{self.value_digest_tokens!r} with rest_attention={self.rest_attention!r}")
            return
        if self.value_digest_tokens is None:
            # the largest valid size up to the measured one: fewer tokens a mean cost more L1 bytes
            fits = [v for v in range(self.digest_tokens, DEFAULT_VALUE_DIGEST_TOKENS + 1, self.digest_tokens)
                    if self.block_tokens % v == 0]
            derive(self, "value_digest_tokens", fits[-1] if fits else self.digest_tokens)
        check_int("value_digest_tokens", self.value_digest_tokens, 1, self.block_tokens)
        if self.value_digest_tokens % self.digest_tokens or self.block_tokens % self.value_digest_tokens:
            raise ValueError(f"value_digest_tokens must be a multiple of digest_tokens ({self.digest_tokens}) "
                             f"that divides block_tokens ({self.block_tokens}); got {self.value_digest_tokens}")

    def role_codec(self, name: str, role: str) -> str:
        """The codec ``role`` (``"key"`` or ``"value"``) is stored in where a tier stores codec
        ``name``: ``key_codec``/``value_codec`` in place of ``codec``, else ``name`` itself."""
        assert role in ("key", "value"), f"role is 'key' or 'value', got {role!r}"
        own = self.key_codec if role == "key" else self.value_codec
        # the store renames a 16-bit lossless tier codec to the model's KV dtype's (fp16 <-> bf16),
        # so either 16-bit name stands for ``codec`` when ``codec`` is one of them
        same = name == self.codec or (name in LOSSLESS_CODECS and self.codec in LOSSLESS_CODECS)
        return own if same and own is not None else name

    def codec_pair(self, name: str) -> tuple:
        """The (key, value) ``kvtier.compress`` codec objects of tier codec ``name``: each role's
        codec (:meth:`role_codec`) with its arguments (:meth:`codec_kwargs`)."""
        from kvtier.compress import get_codec

        return tuple(get_codec(c, **self.codec_kwargs(c, role))
                     for role, c in (("key", self.role_codec(name, "key")), ("value", self.role_codec(name, "value"))))

    def codec_kwargs(self, name: str, role: str) -> dict:
        """The ``kvtier.compress.get_codec`` arguments of codec ``name`` for ``role`` (``"key"``
        or ``"value"``): group size, axis (for int8 values ``int8_value_axis``), for int2 keys
        ``int2_key_outliers``, for int8 the role's ``int8_zero_point``, and for integer keys
        ``key_transform``."""
        assert role in ("key", "value"), f"role is 'key' or 'value', got {role!r}"
        axis = self.key_axis if role == "key" else self.value_axis
        if name == "int8" and role == "value" and self.int8_value_axis is not None:
            axis = self.int8_value_axis
        kw = {"group_size": self.group_size, "axis": axis}
        n = self.key_outliers(name) if role == "key" and axis == "channel" else 0
        if n:
            kw["outliers"] = n
        if name == "int8" and self.int8_zero_point in (role, "both"):
            kw["zero_point"] = True
        if role == "key" and name in PRECISION_CODECS and self.key_transform != "none":
            kw["transform"] = self.key_transform
        return kw

    def key_outliers(self, name: str) -> int:
        """Key channels per block and KV head that this store's records of codec ``name`` keep
        exactly (``key_axis="channel"``): ``cold_key_outliers`` for the cold level's codec when
        set, ``int2_key_outliers`` for int2, else none."""
        if self.precision == "importance" and self.cold_key_outliers is not None \
                and name == self.cold_codec != self.codec:
            return self.cold_key_outliers
        return self.int2_key_outliers if name == "int2" else 0

    def user_set(self) -> dict[str, Any]:
        """The fields as the user set them: a derived value (``host_codec`` filled from ``order``,
        the default ``budget_tokens``, ...) is ``None``, so building a config from this dict
        derives it again from the other fields."""
        return {f.name: (None if isinstance(v := getattr(self, f.name), Derived) else v)
                for f in dataclasses.fields(self)}

    def is_derived(self, name: str) -> bool:
        """Whether field ``name`` holds a value this config computed rather than one the user set."""
        return isinstance(getattr(self, name), Derived)

    # -- derived sizes ------------------------------------------------------------------------

    def sink_window(self, budget_tokens: int) -> tuple[int, int]:
        """(sink_tokens, window_tokens) for a sparse budget: the configured values, or the
        defaults: one sink block if the budget has room for it, then up to two window blocks
        but never more than half of what the sink and the open block leave, so that a small
        budget still selects by query (a 48-token budget of 16-token blocks: sink, one block
        chosen by query, open block; with the window taking the rest, recall would be nil)."""
        bt = self.block_tokens
        sink = self.sink_tokens
        if sink is None:
            sink = bt if budget_tokens >= 2 * bt else 0
        window = self.window_tokens
        if window is None:
            room = max(0, budget_tokens - bt - round_up(sink, bt))
            window = min(2 * bt, (room // 2 // bt) * bt)
        return sink, window

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "KVTierConfig":
        """A named starting point (``kvtier.presets.PRESET_NAMES``: "long-context", "offload",
        "lossless", "serve") with any field overridden by keyword, e.g.
        ``KVTierConfig.preset("long-context", disk_path="kvtier-cache")``. What each costs and
        gives: docs/configuration.md."""
        from kvtier.presets import preset_fields

        return cls(**preset_fields(name, overrides, lossless_codec))

    # -- (de)serialisation --------------------------------------------------------------------

    def to_dict(self, resolved: bool = False) -> dict[str, Any]:
        """Every field, JSON-serialisable.

        Args:
            resolved: False (default): the fields as the user set them, derived ones ``None``
                (see :meth:`user_set`), so ``from_dict(cfg.to_dict() | {"codec": "int8"})``
                derives ``host_codec`` again. True: the values in effect, derived ones filled in
                (for reports; building a config from it pins the derived values as if set).
        """
        if not resolved:
            return self.user_set()
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "KVTierConfig":
        if not isinstance(data, dict):
            raise ValueError(f"a KVTierConfig is built from a table of fields (a dict); got a "
                             f"{type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names - RENAMED_FIELDS.keys(), key=str)
        if unknown:
            raise ValueError(f"unknown KVTierConfig field(s) {unknown}; allowed: {sorted(names)}")
        return cls(**data)

    @classmethod
    def from_toml(cls, path: str | Path) -> "KVTierConfig":
        """Load from a TOML file: fields at top level or under a ``[kvtier]`` table. A missing,
        unreadable or malformed file raises ValueError naming it."""
        return cls.from_dict(read_toml(path))


_dataclass_init = KVTierConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self, *args: Any, **fields: Any) -> None:
    # renamed fields keep working for one release (configcheck.RENAMED_FIELDS)
    _dataclass_init(self, *args, **renamed_fields(fields))


KVTierConfig.__init__ = _init

# help(KVTierConfig) and pydoc show what each field means: the docstring under each field is in
# the source only, so the class docstring is built from it (the parser tools/config_doc.py uses).
KVTierConfig.__doc__ = class_doc(KVTierConfig.__doc__, field_docs(Path(__file__).read_text(), "KVTierConfig"))


__all__ = ["KVTierConfig", "CODECS", "MAX_KEY_OUTLIERS", "LOSSLESS_CODECS", "PRECISION_CODECS", "GROUP_SIZES", "DERIVED_FIELDS",
           "DEFAULT_BLOCK_TOKENS", "DEFAULT_DIGEST_TOKENS", "DEFAULT_VALUE_DIGEST_TOKENS", "default_block_tokens", "lossless_codec"]
