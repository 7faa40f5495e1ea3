"""KVStore: block tables over L1 (device pool), L2 (DRAM ring), L3 (SSD segments) and L4 (remote).

```
 append ──► open block, written in place in its L1 slot
              │ sealed (next block opens) -> digest kept in L1 (sparse mode only: the keys'
              │ per-channel mean for select_score="centroid", max|min for "quest", and the
              │ values' means for rest_attention="estimate"; int8 or the KV dtype)
              ▼
 end_step ──► watermarks: victims chosen by the policy
              │ clean (valid copy below): slot freed at once
              │ dirty: queued ──► swap-out worker: encode (host codec) [+ byte stage if
              │                   byte_stage_l2] + put to L2, then free slot
              ▼                          │ L2 ring wraps: spill (transcode if the disk codec
 gather / gather_view / gather_blocks    ▼ differs, byte stage lz4|zstd if it pays) ──► L3
   hit: index the pool
   miss: prefetched? else L2 / L3 -> unpack -> decode on the device -> slot (or scratch)
```

This class checks arguments and hands the work to its parts; docs/architecture.md shows them, who calls
whom, and the lock order.
"""
from __future__ import annotations

import math
import time

import torch

from kvtier.config import KVTierConfig

from . import invariants
from .append import Appender
from .blockio import BlockIO
from .content import ContentIndex
from .evictor import Evictor
from .layout import Layout, pool_slots, scratch_slots
from .offload import CONTENT_KEY, OffloadTiers
from .policy import make_policy
from .prefetch import Prefetcher
from .prefix import model_fingerprint_key
from .reads import Reader
from .report import sequences_stats, store_stats
from .residency import Residency
from .select import Selector
from .stats import Counters
from .surgery import SequenceSurgery
from .writethrough import WriteThrough

__all__ = ["KVStore", "CONTENT_KEY"]


class KVStore:
    """Tiered KV storage for one model: all layers, many sequences.

    Args:
        cfg: the configuration.
        num_layers, kv_heads, head_dim: model shape.
        dtype: KV dtype of the model (``cfg.dtype`` overrides it when set).
        device: where L1 lives and where gathered tensors are returned.
        fingerprint: identifies the model (kept for content-addressed keys; reported in stats).
    """

    def __init__(self, cfg: KVTierConfig, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device: torch.device | str | None = None,
                 fingerprint: str = "") -> None:
        from kvtier.tiers import DeviceTier

        lay = self.layout = Layout.resolve(cfg, num_layers, kv_heads, head_dim, dtype, device)
        self.cfg = cfg
        self.fingerprint = fingerprint
        self.policy = make_policy(cfg.policy, lay.sink_blocks, lay.window_blocks)
        self.counters = Counters()
        self.io = BlockIO(cfg, lay, self.counters)
        self.offload = OffloadTiers(cfg, lay, self.io, self.counters)
        # content-addressed keys: the chain seed names the model (weights digest included), every
        # codec a record of this store may carry with the parameters of its K and V encodings as
        # the codecs themselves state them (so no setting that changes the bytes is left out), the
        # dtype, the layout, block_tokens and the namespace: blocks of another model, encoding or
        # deployment never match
        self.content_fp = model_fingerprint_key(
            fingerprint, "|".join(sorted(self.io.by_name)), lay.block_tokens,
            codec_params=self.io.codec_identity(), dtype=lay.dtype,
            extra={"layout": "kvtier", "kv_heads": kv_heads, "head_dim": head_dim, "num_layers": num_layers,
                   "precision": None if lay.precision is None else list(lay.precision.codecs)},
            namespace=cfg.namespace,
        ) if fingerprint else None
        # regions first (placed by the residency part: table.py), then the scratch slots
        regions = cfg.max_sequences * num_layers * lay.device_blocks
        self.l1 = DeviceTier(lay.slot_shape, pool_slots(lay.device_blocks, cfg.max_sequences, num_layers),
                             dtype=lay.dtype, device=lay.device, slot_axis=2, placed_slots=regions)
        self.residency = Residency(lay, self.l1, self.policy, self.counters)
        self.copies = self.residency.copies
        self.offload.residency, self.offload.copies = self.residency, self.copies
        self.evictor = Evictor(lay, self.residency, self.io, self.offload, self.counters, cfg.evict_batch_blocks)
        # write-through of content-addressed blocks to L3 (reuse after restart) and L4 (sharing
        # across processes), batched and off the decode path
        self.publisher = None
        if (self.l3 is not None or self.l4 is not None) and self.content_fp and cfg.write_through:
            self.publisher = WriteThrough(self.copies, self.io, self.offload, self.counters,
                                          cfg.evict_batch_blocks)
            self.copies.publish_to = (self.l3 is not None, self.l4 is not None)
        self.content = ContentIndex(lay, self.content_fp, self.residency, self.io, self.offload,
                                    self.counters, self.publisher)
        # "auto": only where swap-ins decode on another engine (GPU); on a CPU host the thread
        # competes with the decode step for the cores and the GIL (config.py, bench_store.py)
        self.prefetch = cfg.prefetch if cfg.prefetch != "auto" else lay.cuda
        self.prefetcher = Prefetcher(self.offload, self.counters, cfg.prefetch_blocks, self.prefetch)
        self.surgery = SequenceSurgery(self.residency, self.offload, self.evictor, self.content)
        self.appender = Appender(lay, self.residency, self.evictor,
                                 self.content if self.content_fp is not None else None, self.surgery)
        self.reader = Reader(lay, self.residency, self.prefetcher, self.counters)
        self.selector = Selector(lay, self.residency)
        self._last_end_step: float | None = None
        self._swaps_at_step = 0  # swap_in_blocks at the last end_step
        self._closed = False

    # -- the model shape and the derived sizes (read-only) --------------------------------------

    num_layers = property(lambda self: self.layout.num_layers)
    kv_heads = property(lambda self: self.layout.kv_heads)
    head_dim = property(lambda self: self.layout.head_dim)
    dtype = property(lambda self: self.layout.dtype)
    device = property(lambda self: self.layout.device)
    block_tokens = property(lambda self: self.layout.block_tokens)
    slot_bytes = property(lambda self: self.layout.slot_bytes)
    # L1 blocks per (sequence, layer): Layout.device_blocks, under the name of the store contract
    hot_blocks = property(lambda self: self.layout.device_blocks)
    budget_tokens = property(lambda self: self.layout.budget_tokens)
    sink_blocks = property(lambda self: self.layout.sink_blocks)
    window_blocks = property(lambda self: self.layout.window_blocks)
    host_codec = property(lambda self: self.layout.host_codec)
    disk_codec = property(lambda self: self.layout.disk_codec)
    l2 = property(lambda self: self.offload.l2)
    l3 = property(lambda self: self.offload.l3)
    l4 = property(lambda self: self.offload.l4)

    # -- sequences ------------------------------------------------------------------------------

    def add_sequence(self) -> int:
        """Register a new sequence; returns its id. The L1 pool grows when every region group
        is taken (:meth:`reserve_sequences`)."""
        self._check_open()
        while True:
            seq = self.residency.add_sequence()
            if seq is not None:
                return seq
            self.reserve_sequences(1)

    def reserve_sequences(self, n: int) -> None:
        """Make room in L1 for ``n`` more live sequences, growing the pool if needed: to twice
        its sequences or to what ``n`` needs, whichever is more, within ``device_max_bytes``.

        Raises:
            MemoryError naming the bytes when the bound or the device cannot hold them (the
            pool stays as it was).
        """
        residency = self.residency
        with residency.pool_lock:  # no append writes the pool while it moves
            short = n - residency.free_groups()
            if short <= 0:
                return
            lay = self.layout
            per = (lay.num_layers * lay.device_blocks + scratch_slots(lay.device_blocks, 1)) * lay.slot_bytes
            have = residency.groups
            want = max(2 * have, have + short)
            limit = self.cfg.device_max_bytes
            if limit is not None:
                want = min(want, limit // per)
            if want < have + short:
                raise MemoryError(
                    f"kvtier L1: {len(self.sequences()) + n} live sequences need {(have + short) * per:,} "
                    f"bytes of device pool ({per:,} per sequence: device_tokens x {lay.num_layers} layers "
                    f"and its scratch slots); device_max_bytes={limit:,}. Raise device_max_bytes, lower "
                    f"device_tokens, or close caches you no longer use")
            self.flush()  # no swap-out reads a slot while the pool moves
            try:
                residency.add_groups(want - have, scratch_slots(lay.device_blocks, 1))
            except MemoryError as exc:
                raise MemoryError(
                    f"kvtier L1: growing the device pool from {have} to {want} sequences "
                    f"({have * per:,} -> {want * per:,} bytes, {per:,} per sequence) failed on "
                    f"{lay.device}; lower device_tokens, set device_max_bytes, or close caches you no "
                    f"longer use ({exc})") from exc
            self.counters.add(l1_growths=1)

    def seq_len(self, seq: int, layer: int) -> int:
        return self.residency.table(seq, layer).length

    def sequences(self) -> list[int]:
        return self.residency.sequences()

    def drop_sequence(self, seq: int, keep_prefix: bool = False) -> None:
        """Forget a sequence: its L1 slots, prefetched blocks, and each block's copies below L1
        once no other sequence holds that block (reference count 0).

        Args:
            keep_prefix: keep the L3 copies of its content-addressed blocks (and never delete L4
                ones) when their last reference goes, so that a later sequence or process finds
                them with :meth:`match_prefix`; L3 reclaims such unreferenced records when full.
        """
        self._check_open()
        self.residency.tables_of(seq)  # a live sequence, else ValueError
        self.flush()  # no swap-out or write-through of one of its blocks may be in flight
        self.prefetcher.forget(seq)
        drop2, drop3 = self.residency.drop(seq, keep_prefix)
        self.content.forget(seq)
        self.offload.delete(drop2, drop3)

    @property
    def closed(self) -> bool:
        return self._closed

    def free_sequences(self) -> int:
        """How many more sequences the L1 pool holds now without growing."""
        return self.residency.free_groups()

    def add_sequences(self, n: int) -> list[int]:
        """Register ``n`` new sequences, all or none (the pool grown first if needed; a
        MemoryError from :meth:`reserve_sequences` registers nothing)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0; got {n!r}")
        self._check_open()
        self.reserve_sequences(n)
        seqs: list[int] = []
        try:
            for _ in range(n):
                seqs.append(self.add_sequence())
        except BaseException:
            for seq in seqs:
                self.drop_sequence(seq)
            raise
        return seqs

    def truncate_sequence(self, seq: int, length: int) -> None:
        """Cut every layer of ``seq`` holding more than ``length`` tokens back to ``length``.

        Blocks past the cut lose this reference (their copies go once no other sequence holds
        them; content-addressed L3 copies stay for :meth:`match_prefix`). The block the cut falls
        in becomes the open block again: from its L1 slot (full precision) when resident, else
        decoded from its nearest copy, so with a lossy codec its kept tokens are the codec's
        reconstruction. Token ids noted for ``seq`` are cut too (``surgery.py``).
        """
        self._check_open()
        tables = self.residency.tables_of(seq)
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"length must be an int >= 0; got {length!r}")
        if all(t.length <= length for t in tables):
            return
        self.flush()  # no swap-out or write-through of its blocks in flight
        self.prefetcher.forget(seq)
        self.surgery.truncate(tables, length)

    def fork_sequence(self, src: int) -> int:
        """A new sequence holding what ``src`` holds: its sealed blocks share ``src``'s copies
        below L1 (reference count + 1); L1 is copied region for region, the open block included
        (copy-on-write). MemoryError when L1 cannot grow for it, registering nothing."""
        self._check_open()
        tables = self.residency.tables_of(src)
        self._raise_failure(src)
        dst = self.add_sequences(1)[0]
        try:
            self.surgery.fork(tables, self.residency.tables_of(dst))
        except BaseException:
            self.drop_sequence(dst)
            raise
        return dst

    # -- token ids and content-addressed keys ---------------------------------------------------

    def note_tokens(self, seq: int, token_ids, salt: str = "") -> None:
        """Token ids of tokens appended (or about to be appended) to ``seq``, in order.

        Every full block whose ids are known when it is sealed gets a content-addressed key
        (``kvtier.store.prefix``): identical prefixes of the same model and codecs share one copy
        per tier (reference counted), persist in L3 across processes and are published to L4.
        Call it before (or right after) the ``append`` of those tokens; blocks already sealed
        and copied below L1 without ids keep their process-local keys.

        Args:
            token_ids: 1-D ints (list, array or tensor), the next tokens of ``seq``.
            salt: the tenant key of ``seq`` (the same on every call for one sequence): blocks
                of sequences with different salts never share a key.
        """
        self._check_open()
        self.residency.tables_of(seq)
        self._raise_failure(seq)
        if self.content_fp is None:
            raise ValueError("fingerprint must be a non-empty model fingerprint to use token ids "
                             "(KVStore(..., fingerprint=...)): keys are only shared within one model")
        self.content.note_tokens(seq, token_ids, salt)

    def tokens_noted(self, seq: int) -> int:
        """How many token ids of ``seq`` the store was given."""
        return self.content.tokens_noted(seq)

    def match_prefix(self, token_ids, salt: str = "") -> int:
        """Leading tokens of ``token_ids`` available in some tier (L1 of any sequence, L2, L3 or
        L4) for every layer, in whole blocks. 0 without a fingerprint.

        Local tiers are checked first; whatever they lack past the locally available blocks is
        asked of L4 in one pipelined round trip (not one per key)."""
        self._check_open()
        return self.content.match_prefix(token_ids, salt)

    def attach_prefix(self, seq: int, token_ids, salt: str = "") -> int:
        """Link the longest available prefix of ``token_ids`` into the empty sequence ``seq``.

        Each whole block found (every layer, in any tier) is read and appended to ``seq`` as if
        it had been computed; sealed, it joins the existing record (refcount + 1, stored once
        below L1). Its token ids are noted; the caller notes and appends only the rest.

        Returns:
            The number of tokens attached (a multiple of ``block_tokens``; 0 if none).
        """
        self._check_open()
        tables = self.residency.tables_of(seq)
        if any(t.length for t in tables) or self.tokens_noted(seq):
            raise ValueError(f"seq must be an empty sequence to attach a prefix; sequence {seq} holds "
                             f"{tables[0].length} tokens")
        ids, hashes = self.content.prefix_hashes(token_ids, salt)
        bt = self.block_tokens
        n = 0
        for b, h in enumerate(hashes):
            data = self.content.read_blocks(h)
            if data is None:
                break
            self.note_tokens(seq, ids[b * bt:(b + 1) * bt], salt)
            for layer, d in enumerate(data):
                self.append(seq, layer, d[0], d[1])  # d: [2, kv_heads, block_tokens, head_dim]
            n += 1
        self.content.count_lookup(ids.size, n * bt, attached=True)
        return n * bt

    def export_blocks(self, seq: int, layer: int) -> tuple[list[bytes], torch.Tensor]:
        """The sealed blocks of (seq, layer) as block records in the L3 (disk codec) format, and the
        open block's tokens [2, kv_heads, t, head_dim] (t >= 0) as they are in L1.

        A block that already has a record in the disk codec (its L3 copy, or its L2 copy when L2
        uses the same codec) is exported as those bytes, so a lossy block is never dequantized and
        quantized again; only blocks with no such copy (resident in L1 only, or in L2 under another
        codec) are encoded here, from their full-precision L1 data or their decoded L2 copy.
        """
        t = self._table(seq, layer)
        n_full, rest = divmod(t.length, self.block_tokens)
        ents = list(t.entries)
        # a partial block is the open one, always resident in L1
        tail = self.residency.open_tokens(t, rest)
        return [self.content.export_record(e) for e in ents[:n_full]], tail

    # -- append and the step boundary -------------------------------------------------------------

    def append(self, seq: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append tokens; k, v: floating-point [kv_heads, t, head_dim] (t = 0 appends nothing)."""
        t = self._table(seq, layer)
        if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
            raise ValueError(f"k and v must be torch tensors; got {type(k).__name__} and {type(v).__name__}")
        if k.dim() != 3 or k.shape != v.shape or k.shape[0] != self.kv_heads or k.shape[2] != self.head_dim:
            raise ValueError(f"k and v must both be [kv_heads={self.kv_heads}, t, head_dim={self.head_dim}]; "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")
        if not (k.is_floating_point() and v.is_floating_point()):
            raise ValueError(f"k and v must be floating-point KV states; got {k.dtype} and {v.dtype}")
        if k.shape[1] == 0:
            return
        if k.device != self.device or k.dtype != self.dtype:
            k = k.to(self.device, self.dtype)
            v = v.to(self.device, self.dtype)
        # Bad KV is refused here, after the cast (float32 KV can overflow the store's 16-bit
        # dtype), with nothing appended. The codecs' own check cannot keep that promise: it runs
        # only when a block is evicted (the open block never is; fp16/bf16 codecs do not check)
        # and on the worker, whose failure keeps the block in L1 and reaches the caller one call
        # late (SwapOutError). On CUDA the check would cost a host sync per layer and step; there
        # that later SwapOutError is the report. (aminmax propagates NaN and is several times
        # faster than isfinite().all() on CPU)
        if k.device.type == "cpu" and not all(
                math.isfinite(x.item()) for x in (*torch.aminmax(k), *torch.aminmax(v))):
            raise ValueError(f"k and v must be finite (no NaN or Inf) in the store's dtype {self.dtype}; "
                             f"nothing was appended")
        self.appender.append(t, k, v)

    def end_step(self) -> None:
        """Step boundary: evict to the watermarks (asynchronously) and kick off prefetch."""
        self._check_open()
        now = time.perf_counter()
        swaps = self.counters["swap_in_blocks"]
        if self._last_end_step is not None:
            self.counters.sample("step", now - self._last_end_step)
            self.counters.sample("step_swapped" if swaps != self._swaps_at_step else "step_unswapped",
                                 now - self._last_end_step)
        self._last_end_step = now
        self._swaps_at_step = swaps
        self.evictor.end_step()
        self.prefetcher.end_step(self.residency.live_tables)

    def flush(self) -> None:
        """Wait until every queued swap-out and write-through completed (tests, checkpoints)."""
        self.evictor.drain()
        if self.publisher is not None:
            self.publisher.drain()

    # -- reads ------------------------------------------------------------------------------------

    def gather(self, seq: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense read: every token in order, K and V [kv_heads, T, head_dim] on the device.

        Blocks below L1 are swapped in (made resident while the budget has room, otherwise only
        streamed into the output); the next layer's missing blocks are prefetched meanwhile.
        """
        self._table(seq, layer)  # checked
        return self.reader.gather(self.residency.tables_of(seq), layer)

    def select(self, seq: int, layer: int, query: torch.Tensor, budget_tokens: int | None = None) -> list[int]:
        """Sealed blocks to attend: sinks + recent window + top-k by key digest (centroid or Quest bound).

        Args:
            query: [q_heads, q_len, head_dim], q_heads a multiple of kv_heads (GQA groups
                consecutive query heads per kv head, as transformers' ``repeat_kv``).
            budget_tokens: tokens to attend, the open block included, whole blocks (default: the config's).
        Returns:
            Sorted block indices.
        """
        t, budget = self._select_args(seq, layer, budget_tokens)
        sel = self.selector.select(t, query, budget)
        self.prefetcher.selected(self.residency.tables_of(seq), layer, sel)
        return sel

    def _select_args(self, seq: int, layer: int, budget_tokens: int | None):
        """(the checked table, the checked budget) of a select call."""
        self._check_open()
        if self.layout.digest_score is None:
            raise ValueError(f"select() needs attention='sparse' (key digests are kept only in sparse "
                             f"mode); this store's config has attention={self.cfg.attention!r}")
        t = self._table(seq, layer)
        bt = self.block_tokens
        budget = self.budget_tokens if budget_tokens is None else budget_tokens
        if budget > self.layout.device_blocks * bt or budget < bt or budget % bt:
            # whole blocks only: a selection is whole blocks, another count would be rounded down
            raise ValueError(f"budget_tokens must be a whole number of blocks (block_tokens={bt}) in "
                             f"[{bt}, {self.layout.device_blocks * bt}]; got {budget}")
        return t, budget

    @property
    def estimates_rest(self) -> bool:
        """Whether :meth:`estimate_rest` has a digest to estimate from (sparse mode with
        ``rest_attention="estimate"``)."""
        return self.layout.value_parts > 0 and self.layout.digest_score is not None

    def select_with_rest(self, seq: int, layer: int, query: torch.Tensor, budget_tokens: int, scaling: float,
                         visible: torch.Tensor | None = None) -> tuple[list[int], tuple | None]:
        """:meth:`select`, and :meth:`estimate_rest` of the blocks it leaves out (in one pass of
        the scorer where it can): ``(blocks, (out, lse) or None)``; the decode path's call with
        ``rest_attention="estimate"``."""
        self._need_estimates()
        t, budget = self._select_args(seq, layer, budget_tokens)
        sel, est = self.selector.select_with_rest(t, query, budget, scaling, visible)
        self.prefetcher.selected(self.residency.tables_of(seq), layer, sel)
        return sel, est

    def estimate_rest(self, seq: int, layer: int, query: torch.Tensor, chosen, scaling: float,
                      visible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The attention of ``query`` over the sealed blocks not in ``chosen`` (the blocks a
        step attends exactly), estimated from their digests: ``(out, lse)`` or None when none
        is left (see :meth:`.select.Selector.rest_estimate`, which documents the arguments)."""
        self._need_estimates()
        return self.selector.rest_estimate(self._table(seq, layer), query, chosen, scaling, visible)

    def _need_estimates(self) -> None:
        if not self.estimates_rest:
            raise ValueError(f"estimating the unselected blocks needs attention='sparse' and "
                             f"rest_attention='estimate'; this store's config has "
                             f"attention={self.cfg.attention!r}, rest_attention={self.cfg.rest_attention!r}")

    def gather_blocks(self, seq: int, layer: int, blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V of ``blocks`` (sorted sealed indices) followed by the open block, copied out of L1.

        The decode path uses :meth:`gather_view` (no copy); this keeps the order of ``blocks``.

        Returns:
            K, V: [kv_heads, n, head_dim] (owned: copied out of the pool); pos: LongTensor [n] of
            the token positions.
        """
        return self.reader.gather_blocks(self._table(seq, layer), list(blocks))

    def gather_view(self, seq: int, layer: int, blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """K, V of ``blocks`` (distinct sealed indices, any order) and the open block, as views
        of L1 where possible: the decode path's gather.

        The table's region is arranged so that the selected blocks hold its first ``len(blocks)``
        positions (in whatever order they already are) and the open block the next one; only
        blocks that entered or left that run are copied. Where that cannot be done this step (a
        block in a scratch slot because the region is full of dirty blocks, or a block that would
        have to move while the swap-out worker reads it) K and V are copied instead (counted in
        ``stats()["gather"]``). Either way the content is the same.

        Returns:
            K, V: [kv_heads, n, head_dim]. Usually views aliasing the L1 pool: valid only until the
            next call that changes this (seq, layer) (``append``, ``gather_view``,
            ``gather_blocks``, ``gather``, ``drop_sequence``); read them at once, never write them.
            pos: LongTensor [n], the token position of every row of K and V (cached by the
                store while the order stays the same: read it, never write it).
            order: the block indices in the order of K and V, the open block last; pass it to
                :meth:`observe` with one mass per block.
        """
        self._check_open()
        blocks = list(blocks)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"blocks must be distinct; got {sorted(blocks)}")
        return self.reader.gather_view(self._table(seq, layer), blocks)

    # -- attention feedback -----------------------------------------------------------------------

    def observe(self, seq: int, layer: int, blocks, mass) -> None:
        """Accumulate attention mass per gathered block (h2o); the first
        ``snapkv_observe_steps`` observations also form the snapkv importance.

        Args:
            blocks: the block indices passed to ``gather_view`` or ``gather_blocks`` (or every
                sealed block in dense mode).
            mass: [len(blocks)] or [len(blocks) + 1] (the last one for the open block).
        """
        t = self._table(seq, layer)
        self.selector.observe(t, blocks, mass, self.cfg.snapkv_observe_steps)

    def observe_queries(self, seq: int, layer: int, query: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """SnapKV voting: attention of ``query`` (the observation window at the end of prefill,
        [q_heads, w, head_dim]) over every token, pooled per block, fed to :meth:`observe`.
        ``keys``: every token's K as :meth:`gather` returns it ([kv_heads, T, head_dim]), when
        the caller has it (no second gather); by default gathered here."""
        t = self._table(seq, layer)
        if keys is None:
            keys, _ = self.gather(seq, layer)  # [kv_heads, T, hd]
        elif tuple(keys.shape) != (self.kv_heads, t.length, self.head_dim):
            raise ValueError(f"keys must be [{self.kv_heads}, {t.length}, {self.head_dim}] (every token "
                             f"of seq {seq} layer {layer}); got {tuple(keys.shape)}")
        k = keys
        per_block = self.selector.block_mass(t, k, query)
        self.observe(seq, layer, range(len(t.entries) - 1), per_block)

    # -- stats, checks and lifecycle --------------------------------------------------------------

    def stats(self) -> dict:
        """Plain, JSON-serialisable dict of what the store holds and what it cost."""
        return store_stats(self)

    def sequences_stats(self, seqs: list[int]) -> dict:
        """What live sequences ``seqs`` hold, per tier, in the README's units (see
        :func:`kvtier.store.report.sequences_stats`)."""
        return sequences_stats(self, seqs)

    def check_invariants(self) -> None:
        """Wait for the background work (:meth:`flush`), then check that every block has one
        consistent picture across the tiers, reference counts and accounting included.

        Raises:
            AssertionError naming the first broken invariant.
        """
        self.flush()
        invariants.check(self.residency, self.offload)

    def _table(self, seq: int, layer: int):
        """The table of live (``seq``, ``layer``) of this open store; first raises the failed
        swap-out of ``seq`` not yet raised (once: the block stays in L1, the store goes on)."""
        self._check_open()
        t = self.residency.table(seq, layer)
        self._raise_failure(seq)
        return t

    def _raise_failure(self, seq: int) -> None:
        err = self.residency.take_failure(seq)
        if err is not None:
            raise err

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("KVStore is closed: its tiers are released; open a new store (or a new "
                               "cache with kvtier.attach) to continue")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.evictor.close()
            if self.publisher is not None:
                self.publisher.close()
        finally:
            try:
                self.prefetcher.close()
            finally:
                self.offload.close()
                self.l1.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

