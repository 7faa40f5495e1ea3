"""KVStore: block tables over L1 (device pool), L2 (DRAM ring) and L3 (SSD segments).

```
 append ──► open block, written in place in its L1 slot
              │ sealed (next block opens) -> key digest kept in L1 (sparse mode only: the
              │ per-channel mean for select_score="centroid", max|min for "quest"; KV dtype)
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

L1 layout: the pool is stored as ``[2, kv_heads, slots, block_tokens, head_dim]`` and every
(sequence, layer) table owns ``hot_blocks`` consecutive slots (its region, ``table.py``); scratch
slots follow the regions. ``gather_view`` keeps the blocks a step attends at the front of the
region, the open block right after them, so K and V are views of the pool (no copy) and only the
blocks that entered the selection are copied (moved within the region).

Locks: ``_tier_lock`` serialises tier I/O (L2/L3) and is always taken *before* ``_lock``, which
guards block tables, entries, L1 slot allocation and moves of blocks within a region;
``_pf_lock`` guards the prefetch buffer only. The decode path never holds a lock while waiting
for anything. Only caller threads allocate L1 slots (a table's own thread, in its region); the
worker frees a slot only after the copy below is complete, and not at all when a reader marked
the block meanwhile (``cancel``: it stays resident, now clean), so a slot being read is never
reused underneath its reader. The worker reads a pending block's slot without the lock, so a
pending block is never moved and its slot never written (``_arrange``).
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import re
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvtier.config import KVTierConfig

from . import cscore
from .blockrecord import BlockDecoder, pack_block, unpack_block
from .keys import block_key
from .policy import make_policy
from .prefix import _token_bytes, chained_block_hashes, model_fingerprint_key
from .stats import Latency, ratio
from .swap import SwapOutWorker
from .table import BlockCopies, BlockEntry, BlockTable

log = logging.getLogger(__name__)

#: Tier keys of content-addressed blocks (``kvtier.store.prefix``): ``m<32 hex>/<layer>/<32 hex>``.
#: Only these survive a restart; process-local keys (``seq/layer/block``) are wiped on open.
CONTENT_KEY = re.compile(r"m[0-9a-f]{32}/[0-9]+/[0-9a-f]{32}")

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

# prefetch predictors, and how a predictor that keeps guessing wrong is throttled
_PF_SOURCES = ("temporal", "next_layer", "dense_next_layer", "dense_next_step")
_PF_WINDOW = 128          # outcomes (used / wasted) remembered per predictor
_PF_MIN_PRECISION = 0.25  # below this a predictor only probes ...
_PF_PROBE = 8             # ... one block in this many


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
        from kvtier.compress import get_codec
        from kvtier.tiers import DeviceTier, HostTier

        if not isinstance(cfg, KVTierConfig):
            raise ValueError(f"cfg must be a KVTierConfig, got {type(cfg).__name__}")
        for name, v in (("num_layers", num_layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1; got {v!r}")
        if cfg.dtype is not None:
            dtype = _DTYPES[cfg.dtype]
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of torch.float16, torch.bfloat16, torch.float32; got {dtype}")
        self.cfg = cfg
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device if device is not None else "cpu")
        self.fingerprint = fingerprint
        self._cuda = self.device.type == "cuda"

        bt = self.block_tokens = cfg.block_tokens
        slot_shape = (2, kv_heads, bt, head_dim)
        self.slot_bytes = math.prod(slot_shape) * torch.empty((), dtype=dtype).element_size()
        if cfg.hot_bytes is not None:
            per = self.slot_bytes * num_layers * cfg.max_sequences
            self.hot_blocks = cfg.hot_bytes // per
            if self.hot_blocks < 1:
                raise ValueError(f"hot_bytes must hold at least one block per layer and sequence "
                                 f"(>= {per} bytes for this model and max_sequences); got {cfg.hot_bytes}")
        else:
            self.hot_blocks = cfg.hot_tokens // bt
        budget = cfg.budget_tokens if cfg.budget_tokens is not None else self.hot_blocks * bt
        if budget > self.hot_blocks * bt:
            raise ValueError(f"budget_tokens must be <= the L1 budget ({self.hot_blocks * bt} tokens); got {budget}")
        self.budget_tokens = budget
        sink, window = cfg.sink_window(budget)
        self.sink_blocks = -(-sink // bt)
        self.window_blocks = -(-window // bt)
        if self.sink_blocks + self.window_blocks + 1 > budget // bt:
            raise ValueError(f"budget_tokens must be >= sink_tokens + window_tokens + one open block; "
                             f"got budget {budget} with sink_tokens={sink}, window_tokens={window}, "
                             f"block_tokens={bt} (L1 budget from hot_bytes: {self.hot_blocks} blocks)")
        c = self.hot_blocks
        self._high = min(c, max(1, math.ceil(cfg.high_watermark * c)))
        self._low = min(self._high, c - 1, max(0, math.floor(cfg.low_watermark * c)))
        self.policy = make_policy(cfg.policy, self.sink_blocks, self.window_blocks)

        # Codecs per tier, one per role: keys grouped per channel, values per token (KIVI).
        def pair(name: str):
            return (get_codec(name, group_size=cfg.group_size, axis=cfg.key_axis),
                    get_codec(name, group_size=cfg.group_size, axis=cfg.value_axis))

        # A full-precision 16-bit tier codec follows the KV dtype (the config may be built before
        # the model's dtype is known; fp16 <-> bf16 would not be lossless and the codecs refuse it).
        lossless16 = "bf16" if dtype == torch.bfloat16 else "fp16"
        self.host_codec = lossless16 if cfg.host_codec in ("fp16", "bf16") and dtype != torch.float32 else cfg.host_codec
        self.disk_codec = lossless16 if cfg.disk_codec in ("fp16", "bf16") and dtype != torch.float32 else cfg.disk_codec
        self._codecs = {"l2": pair(self.host_codec), "l3": pair(self.disk_codec)}
        self._transcode = (self.host_codec != self.disk_codec)
        # CPU: integer-codec block records decoded in place by the compiled kernel (blockrecord.py)
        from kvtier.compress import cpu as _cpu
        from kvtier.compress.codecs import IntCodec
        self._fast_decoders = {
            tier: BlockDecoder(*cs, (kv_heads, bt, head_dim), dtype) for tier, cs in self._codecs.items()
            if all(isinstance(c, IntCodec) for c in cs) and _cpu.available()
        } if self.device.type == "cpu" else {}

        # L3 first: an unwritable disk_path fails before anything is allocated.
        self.l3 = None
        if cfg.disk_path is not None:
            self.l3 = self._open_disk(cfg)
        from kvtier.compress.bytestage import ByteStage
        # lossless byte stage (lz4 | zstd) on records bound for L3/L4, and for L2 if so configured
        self._stage = ByteStage(cfg.byte_stage, cfg.lz4_min_saving)
        self._l2_staged = cfg.byte_stage_l2 and cfg.byte_stage != "none"
        self.l4 = None
        if cfg.remote_url is not None:
            from kvtier.tiers import RemoteTier
            self.l4 = RemoteTier(cfg.remote_url, key_prefix=cfg.remote_key_prefix)
        # content-addressed keys: the chain seed names the model, both codecs and their parameters,
        # the dtype and block_tokens, so blocks of another model or encoding never match
        self.content_fp = model_fingerprint_key(
            fingerprint, f"{self.host_codec}|{self.disk_codec}", bt,
            codec_params={"group_size": cfg.group_size, "key_axis": cfg.key_axis,
                          "value_axis": cfg.value_axis},
            dtype=dtype, extra={"kv_heads": kv_heads, "head_dim": head_dim, "num_layers": num_layers},
        ) if fingerprint else None

        # a selection fits in the budget, so one read needs at most hot_blocks - 1 scratch slots;
        # one read per live sequence may be in flight at a time (callers on several threads)
        self._scratch_n = max(1, c - 1) * cfg.max_sequences
        self._scratch_ids = itertools.count()
        # regions first (placed by the store: table.py), then the scratch slots
        regions = cfg.max_sequences * num_layers * c
        self.l1 = DeviceTier(slot_shape, regions + self._scratch_n, dtype=dtype, device=self.device,
                             slot_axis=2, placed_slots=regions)
        self._free_groups = list(range(cfg.max_sequences))  # region groups (one region per layer)
        self._group: dict[int, int] = {}
        self.l2 = HostTier(cfg.host_bytes, spill=self._spill if self.l3 is not None else None,
                           pin_memory=self._cuda)
        # [2, kv_heads, num_slots, block_tokens, head_dim]: the pool's storage. One index_select
        # along the slot axis yields K and V already in [kv_heads, blocks, tokens, head_dim] order;
        # a run of slots of one region is, per head, one contiguous run of tokens (gather_view)
        self._pool_kv = self.l1.storage
        # CPU: the pool as a numpy array, for decode appends (16-bit floats viewed as int16)
        self._np_view = torch.int16 if dtype in (torch.float16, torch.bfloat16) else None
        self._pool_np = None
        if self.device.type == "cpu":
            pool = self.l1.pool
            self._pool_np = (pool if self._np_view is None else pool.view(self._np_view)).numpy()
        self._np_arange_bt = np.arange(bt, dtype=np.int64)
        self._zeros111 = torch.zeros(1, 1, 1, device=self.device)
        # key digests only where something reads them: select(), i.e. sparse attention
        self._digest_score = cfg.select_score if cfg.attention == "sparse" else None
        self._digest_parts = cfg.block_tokens // cfg.digest_tokens
        # CPU: block scores in one compiled call, read from the digest table in place (cscore.py)
        self._cscore = (self._digest_score is not None and self.device.type == "cpu"
                        and dtype in cscore.DTYPES and cscore.available())

        self._lock = threading.Lock()
        self._tier_lock = threading.Lock()
        self._tables: dict[int, list[BlockTable]] = {}
        self._by_key: dict[str, BlockEntry] = {}      # process-local key -> entry
        self._recs: dict[str, BlockCopies] = {}       # tier key -> copies below L1 (refcounted)
        self._tok: dict[int, _SeqTokens] = {}          # token ids noted per sequence
        self._known_l4: set[str] = set()              # keys just read from L4 (no need to publish)
        self._last_sel: dict[tuple[int, int], list[int]] = {}
        self._dense_seqs: set[int] = set()
        self._touched: dict[int, BlockTable] = {}
        self._next_seq = 0
        self._step = 0
        self._last_end_step: float | None = None
        self._side = torch.cuda.Stream(device=self.device) if self._cuda else None
        self._worker = SwapOutWorker(self._swap_out_batch, cfg.evict_batch_blocks)
        # write-through of content-addressed blocks to L3 (reuse after restart) and L4 (sharing
        # across processes), batched and off the decode path
        self._publisher = SwapOutWorker(self._publish_batch, max(cfg.evict_batch_blocks, 64),
                                        name="kvtier-publish") \
            if (self.l3 is not None or self.l4 is not None) and self.content_fp and cfg.write_through else None
        # "auto": only where swap-ins decode on another engine (GPU); on a CPU host the thread
        # competes with the decode step for the cores and the GIL (config.py, bench_store.py)
        self.prefetch = cfg.prefetch if cfg.prefetch != "auto" else self._cuda
        self._pf_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-prefetch") \
            if self.prefetch else None
        self._pf: OrderedDict[str, Future] = OrderedDict()
        self._pf_lock = threading.Lock()  # guards _pf only; never held while waiting
        # Wrong prefetches cost decode work and bandwidth: each predictor (source) is throttled
        # to one probe in _PF_PROBE while its precision over its last outcomes is below the floor.
        self._pf_outcomes = {src: deque(maxlen=_PF_WINDOW) for src in _PF_SOURCES}
        self._pf_skipped = dict.fromkeys(_PF_SOURCES, 0)
        self._pf_stats = {src: {"issued": 0, "used": 0, "wasted": 0, "throttled": 0} for src in _PF_SOURCES}
        self._closed = False

        # counters (plain ints; read together in stats())
        self.c = dict(hits_l1=0, misses_l1=0, hits_l2=0, misses_l2=0, hits_l3=0, misses_l3=0,
                      swap_in_l2_bytes=0, swap_in_l3_bytes=0, swap_out_l2_bytes=0, swap_out_l3_bytes=0,
                      swap_in_blocks=0, swap_out_blocks=0, evicted_clean=0, evicted_dirty=0,
                      evict_failed=0, sync_evictions=0, scratch_uses=0,
                      pf_issued=0, pf_errors=0, pf_used=0, pf_wasted=0,
                      raw_l2=0, enc_l2=0, raw_l3=0, enc_l3=0, stage_in=0, stage_out=0,
                      bytes_l2=0, bytes_l3=0, copies_l2=0, copies_l3=0,
                      hits_l4=0, misses_l4=0, swap_in_l4_bytes=0,
                      pub_l3_blocks=0, pub_l3_bytes=0, pub_l3_failed=0,
                      pub_l4_blocks=0, pub_l4_bytes=0, pub_l4_failed=0, orphans_deleted=0,
                      prefix_lookups=0, prefix_lookup_tokens=0, prefix_hit_tokens=0,
                      prefill_tokens_saved=0, dedup_seals=0, adopted_l3=0,
                      gather_views=0, gather_copies=0, region_moves=0)
        # blocks per home tier, kept up to date under _lock so that stats() costs O(tables)
        self._home = {"l1": 0, "l2": 0, "l3": 0}
        self._lat_in = Latency()
        self._lat_out = Latency()
        self._lat_step = Latency()

    # -- construction helpers -------------------------------------------------------------------

    @staticmethod
    def _open_disk(cfg: KVTierConfig):
        from kvtier.tiers import DiskTier

        path = cfg.disk_path
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as e:
            raise ValueError(f"disk_path must be a writable directory; cannot create {path!r}: {e}") from e
        if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"disk_path must be a writable directory; {path!r} is not")
        try:
            l3 = DiskTier(path, capacity_bytes=cfg.disk_bytes, segment_bytes=cfg.disk_segment_bytes,
                          durability=cfg.durability)
        except PermissionError as e:
            raise ValueError(f"disk_path must be a writable directory; {path!r}: {e}") from e
        # Process-local keys name (sequence, layer, block) of an earlier store: they cannot be
        # addressed again and would only take capacity. Content-addressed records are kept: a
        # later store of the same model and codecs finds them by key (reuse after restart).
        stale = [k for k in l3.keys() if not CONTENT_KEY.fullmatch(k)]
        if stale:
            l3.delete_many(stale)
        return l3

    # -- sequences --------------------------------------------------------------------------

    def add_sequence(self) -> int:
        """Register a new sequence; returns its id."""
        self._check_open()
        with self._lock:
            if len(self._tables) >= self.cfg.max_sequences:
                raise ValueError(f"max_sequences ({self.cfg.max_sequences}) live sequences already; "
                                 f"raise max_sequences or drop a sequence first")
            seq = self._next_seq
            self._next_seq += 1
            g = self._group[seq] = self._free_groups.pop(0)
            c = self.hot_blocks
            self._tables[seq] = [BlockTable(seq, layer, self.kv_heads, self.head_dim, self.device,
                                            self.dtype, self._digest_score, self._digest_parts,
                                            base=(g * self.num_layers + layer) * c, cap=c)
                                 for layer in range(self.num_layers)]
            return seq

    def _table(self, seq: int, layer: int) -> BlockTable:
        try:
            return self._tables[seq][layer]
        except KeyError:
            raise ValueError(f"seq must be a live sequence id {sorted(self._tables)}; got {seq!r}") from None
        except (IndexError, TypeError):
            raise ValueError(f"layer must be in [0, {self.num_layers}); got {layer!r}") from None

    def seq_len(self, seq: int, layer: int) -> int:
        return self._table(seq, layer).length

    def sequences(self) -> list[int]:
        return sorted(self._tables)

    def drop_sequence(self, seq: int, keep_prefix: bool = False) -> None:
        """Forget a sequence: its L1 slots, prefetched blocks, and each block's copies below L1
        once no other sequence holds that block (reference count 0).

        Args:
            keep_prefix: keep the L3 copies of its content-addressed blocks (and never delete L4
                ones) when their last reference goes, so that a later sequence or process finds
                them with :meth:`match_prefix`; L3 reclaims such unreferenced records when full.
        """
        self._check_open()
        tables = self._tables.get(seq)
        if tables is None:
            raise ValueError(f"seq must be a live sequence id {sorted(self._tables)}; got {seq!r}")
        self._worker.drain()  # no swap-out of this sequence may be in flight
        if self._publisher is not None:
            self._publisher.drain()  # nor a write-through of one of its blocks
        prefix = f"{seq}/"
        with self._pf_lock:
            mine = [self._pf.pop(k) for k in list(self._pf) if k.startswith(prefix)]
        for fut in mine:
            self._discard_prefetch(fut)
        drop2, drop3 = [], []
        with self._lock:
            for t in tables:
                for e in t.entries:
                    self._home[e.home] -= 1
                    if e.slot is not None:
                        self.l1.delete(e.key)
                        e.slot = None
                    rec = e.rec
                    rec.entries.remove(e)
                    if not rec.entries:  # last reference: the copies below L1 go too
                        if self._recs.get(rec.key) is rec:
                            del self._recs[rec.key]
                        if rec.l2:
                            drop2.append(rec.key)
                        if rec.l3 and not (keep_prefix and rec.content):
                            drop3.append(rec.key)
                    self._by_key.pop(e.key, None)
                self._touched.pop(id(t), None)
                self._last_sel.pop((seq, t.layer), None)
            del self._tables[seq]
            self._free_groups.append(self._group.pop(seq))
            self._tok.pop(seq, None)
            self._dense_seqs.discard(seq)
        with self._tier_lock:
            self.l2.delete_many(drop2)
            if self.l3 is not None:
                self.l3.delete_many(drop3)
            with self._lock:
                self._recount()

    def _recount(self) -> None:
        """Copies and bytes below L1 from the live records (lock held)."""
        live = self._recs.values()
        self.c["copies_l2"] = sum(1 for r in live if r.l2)
        self.c["copies_l3"] = sum(1 for r in live if r.l3)
        self.c["bytes_l2"] = sum(r.l2_bytes for r in live if r.l2)
        self.c["bytes_l3"] = sum(r.l3_bytes for r in live if r.l3)

    # -- token ids and content-addressed keys ---------------------------------------------------

    def note_tokens(self, seq: int, token_ids) -> None:
        """Token ids of tokens appended (or about to be appended) to ``seq``, in order.

        Every full block whose ids are known when it is sealed gets a content-addressed key
        (``kvtier.store.prefix``): identical prefixes of the same model and codecs share one copy
        per tier (reference counted), persist in L3 across processes and are published to L4.
        Call it before (or right after) the ``append`` of those tokens; blocks already sealed
        and copied below L1 without ids keep their process-local keys.

        Args:
            token_ids: 1-D ints (list, array or tensor), the next tokens of ``seq``.
        """
        self._check_open()
        if seq not in self._tables:
            raise ValueError(f"seq must be a live sequence id {sorted(self._tables)}; got {seq!r}")
        if self.content_fp is None:
            raise ValueError("fingerprint must be a non-empty model fingerprint to use token ids "
                             "(KVStore(..., fingerprint=...)): keys are only shared within one model")
        ids = _token_bytes(token_ids)
        st = self._tok.setdefault(seq, _SeqTokens())
        before = len(st.hashes)
        st.add(ids, self.block_tokens, self.content_fp)
        if len(st.hashes) > before:
            # blocks sealed before their ids arrived (ids noted after the append)
            for t in self._tables[seq]:
                for e in t.entries[before:min(len(st.hashes), t.n_sealed)]:
                    self._assign_content(t, e)

    def tokens_noted(self, seq: int) -> int:
        """How many token ids of ``seq`` the store was given."""
        st = self._tok.get(seq)
        return st.count if st is not None else 0

    def _content_key(self, layer: int, block_hash: str) -> str:
        return f"{self.content_fp}/{layer}/{block_hash}"

    def _assign_content(self, t: BlockTable, e: BlockEntry) -> None:
        """Give sealed entry ``e`` its content-addressed copies if its token ids are known:
        join the existing record (dedup, refcount + 1) or create one, adopting an L3 copy left
        by an earlier process; a new record is queued for write-through to L3/L4."""
        st = self._tok.get(t.seq)
        if st is None or e.idx >= len(st.hashes):
            return
        key = self._content_key(t.layer, st.hashes[e.idx])
        with self._lock:
            old = e.rec
            if old.content or old.l2 or old.l3 or e.pending or e.slot is None:
                return
            rec = self._recs.get(key)
        adopt = None
        if rec is None and self.l3 is not None:
            with self._tier_lock:
                if self.l3.contains(key):
                    adopt = self._l3_size(key)
        with self._lock:
            rec = self._recs.get(key)
            new = rec is None
            if new:
                rec = self._recs[key] = BlockCopies(key, content=True)
                rec.l4 = key in self._known_l4
                if adopt is not None:
                    rec.l3 = rec.wt = True
                    rec.l3_bytes = adopt
                    self.c["copies_l3"] += 1
                    self.c["bytes_l3"] += adopt
                    self.c["adopted_l3"] += 1
            else:
                self.c["dedup_seals"] += 1
            self._known_l4.discard(key)
            old.entries.remove(e)
            if not old.entries and self._recs.get(old.key) is old:
                del self._recs[old.key]
            e.rec = rec
            rec.entries.append(e)
            publish = self._publisher is not None and \
                ((self.l3 is not None and not rec.l3) or (self.l4 is not None and not rec.l4))
            data = self.l1.pool[e.slot].clone() if (new and publish) else None  # [2, kv_heads, bt, hd]
        if data is not None:
            self._publisher.submit([(rec, data)])

    def _l3_size(self, key: str) -> int | None:
        """Bytes of the L3 value under ``key`` (tier lock held); None when absent or corrupt."""
        size = getattr(self.l3, "value_size", None)
        if size is not None:
            return size(key)
        buf = self.l3.get(key)
        return None if buf is None else len(buf)

    def _prefix_keys(self, token_ids) -> tuple[np.ndarray, list[str]]:
        ids = _token_bytes(token_ids)
        if self.content_fp is None:
            return ids, []
        return ids, chained_block_hashes(ids, self.block_tokens, self.content_fp)

    def match_prefix(self, token_ids) -> int:
        """Leading tokens of ``token_ids`` available in some tier (L1 of any sequence, L2, L3 or
        L4) for every layer, in whole blocks. 0 without a fingerprint.

        Local tiers are checked first; whatever they lack past the locally available blocks is
        asked of L4 in one pipelined round trip (not one per key)."""
        self._check_open()
        ids, hashes = self._prefix_keys(token_ids)
        keys = [[self._content_key(layer, h) for layer in range(self.num_layers)] for h in hashes]
        n = 0
        while n < len(keys) and all(self._available_locally(k) for k in keys[n]):
            n += 1
        if n < len(keys) and self.l4 is not None:
            # the rest: one round trip for every key no local tier has, up to the first block
            # that lacks one everywhere
            missing = [[k for k in block if not self._available_locally(k)] for block in keys[n:]]
            flat = [k for block in missing for k in block]
            found = iter(self.l4.contains_many(flat))
            for block in missing:
                if not all([next(found) for _ in block]):  # consume this block's answers in full
                    break
                n += 1
        with self._lock:
            self.c["prefix_lookups"] += 1
            self.c["prefix_lookup_tokens"] += int(ids.size)
            self.c["prefix_hit_tokens"] += n * self.block_tokens
        return n * self.block_tokens

    def _available_locally(self, key: str) -> bool:
        with self._lock:
            rec = self._recs.get(key)
            if rec is not None and (rec.entries or rec.l2 or rec.l3 or rec.l4):
                return True  # an entry always has a copy somewhere (its home)
        if self.l3 is not None:
            with self._tier_lock:
                if self.l3.contains(key):
                    return True
        return False

    def attach_prefix(self, seq: int, token_ids) -> int:
        """Link the longest available prefix of ``token_ids`` into the empty sequence ``seq``.

        Each whole block found (every layer, in any tier) is read and appended to ``seq`` as if
        it had been computed; sealed, it joins the existing record (refcount + 1, stored once
        below L1). Its token ids are noted; the caller notes and appends only the rest.

        Returns:
            The number of tokens attached (a multiple of ``block_tokens``; 0 if none).
        """
        self._check_open()
        tables = self._tables.get(seq)
        if tables is None:
            raise ValueError(f"seq must be a live sequence id {sorted(self._tables)}; got {seq!r}")
        if any(t.length for t in tables) or self.tokens_noted(seq):
            raise ValueError(f"seq must be an empty sequence to attach a prefix; sequence {seq} holds "
                             f"{tables[0].length} tokens")
        ids, hashes = self._prefix_keys(token_ids)
        bt = self.block_tokens
        n = 0
        for b, h in enumerate(hashes):
            data = self._read_blocks([self._content_key(layer, h) for layer in range(self.num_layers)])
            if data is None:
                break
            self.note_tokens(seq, ids[b * bt:(b + 1) * bt])
            for layer, d in enumerate(data):
                self.append(seq, layer, d[0], d[1])  # d: [2, kv_heads, block_tokens, head_dim]
            n += 1
        with self._lock:
            self.c["prefix_lookups"] += 1
            self.c["prefix_lookup_tokens"] += int(ids.size)
            self.c["prefix_hit_tokens"] += n * bt
            self.c["prefill_tokens_saved"] += n * bt
        return n * bt

    def _read_blocks(self, keys: list[str]) -> list[torch.Tensor] | None:
        """Decoded [2, kv_heads, block_tokens, head_dim] blocks under ``keys`` (one per layer) from
        the nearest tier holding each, L4 last in one batch; None as soon as one is missing."""
        out: list[torch.Tensor | None] = []
        missing = []
        for i, key in enumerate(keys):
            d = self._read_local(key)
            if d is None:
                if self.l4 is None:
                    return None
                missing.append(i)
            out.append(d)
        if missing:
            t0 = time.perf_counter()
            bufs = self.l4.get_many([keys[i] for i in missing])
            for i, buf in zip(missing, bufs):
                d = self._decode_l3(buf)
                if d is None:
                    self._count(misses_l4=1)
                    return None
                out[i] = d
                self._count(hits_l4=1, swap_in_l4_bytes=len(buf))
            with self._lock:
                self._known_l4.update(keys[i] for i in missing)
                self._lat_in.add((time.perf_counter() - t0) / len(missing))
        return out

    def _decode_l3(self, buf) -> torch.Tensor | None:
        """An L3/L4 record (byte stage + disk codec) decoded on the device; None if absent/corrupt."""
        if buf is None:
            return None
        try:
            return self._decode(self._stage.unpack(buf), "l3", self.device)
        except ValueError:  # foreign or corrupt bytes are a miss, never wrong data
            return None

    def _read_local(self, key: str) -> torch.Tensor | None:
        with self._lock:
            rec = self._recs.get(key)
            if rec is not None:
                for e in rec.entries:
                    if e.slot is not None:  # slots are freed under this lock: safe to copy
                        return self.l1.pool[e.slot].clone()
        if rec is not None:
            d = self._load_copies(rec, self.device)
            if d is not None:
                return d
        if self.l3 is not None:
            with self._tier_lock:
                buf = self.l3.get(key)
            d = self._decode_l3(buf)
            if d is not None:
                self._count(hits_l3=1, swap_in_l3_bytes=len(buf))
                return d
        return None

    def export_blocks(self, seq: int, layer: int) -> tuple[list[bytes], torch.Tensor]:
        """The sealed blocks of (seq, layer) as block records in the L3 (disk codec) format, and the
        open block's tokens [2, kv_heads, t, head_dim] (t >= 0) as they are in L1.

        A block that already has a record in the disk codec (its L3 copy, or its L2 copy when L2
        uses the same codec) is exported as those bytes, so a lossy block is never dequantized and
        quantized again; only blocks with no such copy (resident in L1 only, or in L2 under another
        codec) are encoded here, from their full-precision L1 data or their decoded L2 copy.
        """
        t = self._table(seq, layer)
        bt = self.block_tokens
        with self._lock:
            ents = list(t.entries)
            n_full, rest = divmod(t.length, bt)
            # a partial block is the open one, always resident in L1
            tail = self.l1.pool[ents[n_full].slot, :, :, :rest].clone() if rest else \
                torch.empty(2, self.kv_heads, 0, self.head_dim, dtype=self.dtype, device=self.device)
        return [self._export_record(e) for e in ents[:n_full]], tail

    def _export_record(self, e: BlockEntry) -> bytes:
        with self._lock:
            rec = e.rec
            l2, l3, key = rec.l2, rec.l3, rec.key
            data = self.l1.pool[e.slot].clone() if e.slot is not None else None
        if l3:
            with self._tier_lock:
                buf = self.l3.get(key)
            if buf is not None:
                raw = self._stage.unpack(buf)
                unpack_block(raw)  # framing and both CRCs checked: corrupt bytes are never exported
                return raw
        if l2 and not self._transcode:
            with self._tier_lock:
                buf = self.l2.get(key)
            if buf is not None:
                raw = self._stage.unpack(buf) if self._l2_staged else bytes(buf)
                unpack_block(raw)
                return raw
        if data is None:
            data = self._load(e)  # [2, kv_heads, block_tokens, head_dim]
        return self._encode(data.to("cpu"), "l3")

    # -- append ------------------------------------------------------------------------------

    def append(self, seq: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append tokens; k, v: [kv_heads, t, head_dim] with t >= 1."""
        t = self._table(seq, layer)
        if k.dim() != 3 or k.shape != v.shape or k.shape[0] != self.kv_heads or k.shape[2] != self.head_dim:
            raise ValueError(f"k and v must both be [kv_heads={self.kv_heads}, t, head_dim={self.head_dim}]; "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")
        n = k.shape[1]
        if n == 0:
            return
        if k.device != self.device or k.dtype != self.dtype:
            k = k.to(self.device, self.dtype)
            v = v.to(self.device, self.dtype)
        pool = self.l1.pool
        bt = self.block_tokens
        pos = t.length
        ents = t.entries
        if ents:
            fill = pos - (len(ents) - 1) * bt
            if fill + n <= bt:
                # decode: the tokens fit in the open block; one copy for K and V together
                e = ents[-1]
                if t.open_np is not None and not k.requires_grad and not v.requires_grad:
                    # CPU: two numpy slice assignments cost about half of the torch stack + copy
                    o = t.open_np  # [2, kv_heads, block_tokens, head_dim] aliasing the slot
                    if self._np_view is None:
                        o[0, :, fill:fill + n] = k.numpy()
                        o[1, :, fill:fill + n] = v.numpy()
                    else:  # 16-bit floats as int16 (numpy has no bfloat16): a bit copy
                        o[0, :, fill:fill + n] = k.view(self._np_view).numpy()
                        o[1, :, fill:fill + n] = v.view(self._np_view).numpy()
                else:
                    t.open_view.narrow(2, fill, n).copy_(torch.stack((k, v)))  # [2, kv_heads, n, head_dim]
                t.length = pos + n
                e.last_used = self._step
                self._touched[id(t)] = t
                return
        off = 0
        while off < n:
            fill = pos - (len(t.entries) - 1) * bt if t.entries else bt
            if fill == bt:
                if t.entries:
                    self._seal(t, t.entries[-1])
                self._open_block(t)
                fill = 0
            take = min(bt - fill, n - off)
            slot = t.entries[-1].slot
            pool[slot, 0, :, fill:fill + take] = k[:, off:off + take]  # [kv_heads, take, head_dim]
            pool[slot, 1, :, fill:fill + take] = v[:, off:off + take]
            off += take
            pos += take
        t.length = pos
        t.entries[-1].last_used = self._step
        self._touched[id(t)] = t

    def _seal(self, t: BlockTable, e: BlockEntry) -> None:
        t.set_digest(e.idx, self.l1.pool[e.slot, 0])  # keys: [kv_heads, block_tokens, head_dim]
        e.last_used = self._step
        if self.content_fp is not None:
            self._assign_content(t, e)

    def _open_block(self, t: BlockTable) -> None:
        idx = len(t.entries)
        e = BlockEntry(idx, block_key(t.seq, t.layer, idx))
        with self._lock:
            # appended first so that the block sealed just before is an eviction candidate
            t.entries.append(e)
            self._by_key[e.key] = e
            self._recs[e.tkey] = e.rec
        self._make_room(t, 1, exclude=frozenset())
        with self._lock:
            # no copy: a slot's tokens past t.length are never read (gather/gather_blocks narrow
            # to the length, a block is sealed full), so the open block needs no zeroing
            # past the last attended run: gather_view moves it to the end of that run
            self._alloc_in(t, e, None, lo=t.view_n)
            self._home["l1"] += 1
        self._open_views(t)

    def _open_views(self, t: BlockTable) -> None:
        """Point the append views at the open block's slot (after it was placed or moved)."""
        slot = t.entries[-1].slot
        t.open_view = self.l1.pool[slot]  # [2, kv_heads, block_tokens, head_dim] (strided)
        if self._pool_np is not None:
            t.open_np = self._pool_np[slot]  # the same slot as a numpy view (CPU)

    def _alloc(self, key: str, data: torch.Tensor) -> int:
        """Copy ``data`` [2, kv_heads, block_tokens, head_dim] into a free scratch slot (lock held)."""
        ok = self.l1.put(key, data)
        assert ok, "L1 scratch slots exhausted although every read stays within its budget"
        return self.l1.slot_of(key)

    def _alloc_in(self, t: BlockTable, e: BlockEntry, data: torch.Tensor | None, lo: int = 0,
                  pos: int | None = None) -> None:
        """Give ``e`` a free position of ``t``'s region (``pos`` if given, else the first at or
        after ``lo`` if any) and copy ``data`` [2, kv_heads, block_tokens, head_dim] there;
        ``None`` leaves the slot as it is (the open block: tokens past ``t.length`` are never
        read). Lock held."""
        p = pos if pos is not None else t.free_position(min(lo, t.cap))
        if p is None:
            p = t.free_position(0)
        assert p is not None, f"region of {t.seq}/{t.layer} full although resident {t.resident} < {t.cap}"
        ok = self.l1.put_at(e.key, t.base + p, data)
        assert ok, f"region slot {t.base + p} refused although free"
        t.take_slot(e, t.base + p)

    def _make_room(self, t: BlockTable, need: int, exclude) -> None:
        """Ensure ``need`` more blocks of ``t`` fit in L1. Waits only when L1 is truly full."""
        c = self.hot_blocks
        while t.resident + need > c:
            over = t.resident + need - c
            with self._lock:
                for b in self.policy.victims(t, over, exclude, only_clean=True, force=True):
                    self._free_clean(t, t.entries[b])
            if t.resident + need <= c:
                return
            self.c["sync_evictions"] += 1
            if t.pending:
                self._worker.drain()
                continue
            n = max(over, t.resident - t.pending - self._low)
            with self._lock:
                victims = self.policy.victims(t, n, exclude, force=True)
                items = self._mark_victims(t, victims)
            self._worker.submit(items)
            if not victims:
                raise AssertionError(f"L1 full for {t.seq}/{t.layer} with nothing evictable")
            before = t.resident
            self._worker.drain()
            if t.resident >= before:
                raise RuntimeError(
                    "kvtier: L1 budget full and L2 refused the blocks (host_bytes full and no L3: "
                    "raise host_bytes or set disk_path)")

    def _free_clean(self, t: BlockTable, e: BlockEntry) -> None:
        """Drop the L1 copy of a clean block (lock held)."""
        assert e.clean and e.slot is not None and not e.pending, f"not a clean resident block: {e}"
        self.l1.delete(e.key)
        t.free_slot(e)
        self._home["l1"] -= 1
        self._home[e.home] += 1
        self.c["evicted_clean"] += 1

    def _mark_victims(self, t: BlockTable, victims: list[int]) -> list:
        """Free clean victims now; mark dirty ones pending and return them for the worker (lock held)."""
        items = []
        for b in victims:
            e = t.entries[b]
            if e.clean:
                self._free_clean(t, e)
                continue
            e.pending = True
            e.cancel = False
            t.pending += 1
            if self._cuda:
                e.fence = torch.cuda.Event()  # after the last write into the slot
                e.fence.record()
            items.append((t, e))
        return items

    # -- step boundary -----------------------------------------------------------------------

    def end_step(self) -> None:
        """Step boundary: evict to the watermarks (asynchronously) and kick off prefetch."""
        now = time.perf_counter()
        if self._last_end_step is not None:
            self._lat_step.add(now - self._last_end_step)
        self._last_end_step = now
        self._step += 1
        touched = list(self._touched.values())
        self._touched.clear()
        items = []
        with self._lock:
            for t in touched:
                live = t.resident - t.pending
                if live >= self._high:
                    items += self._mark_victims(t, self.policy.victims(t, live - self._low))
        self._worker.submit(items)
        if self._pf_pool is not None:
            # temporal locality: what each layer attended last step is wanted again
            for (seq, layer), sel in list(self._last_sel.items()):
                tables = self._tables.get(seq)
                if tables is not None:
                    self._prefetch(tables[layer], sel, "temporal")
            # dense: the next step starts again at layer 0
            dense = list(self._dense_seqs)
            self._dense_seqs.clear()
            for seq in dense:
                tables = self._tables.get(seq)
                if tables is not None:
                    self._prefetch(tables[0], range(len(tables[0].entries)), "dense_next_step")

    def flush(self) -> None:
        """Wait until every queued swap-out and write-through completed (tests, checkpoints)."""
        self._worker.drain()
        if self._publisher is not None:
            self._publisher.drain()

    # -- swap-out (worker thread) ------------------------------------------------------------

    def _swap_out_batch(self, batch: list) -> None:
        t0 = time.perf_counter()
        done = 0
        try:
            if self._cuda:
                # quantize on the side stream, copy the encodings into pinned host memory
                # asynchronously, wait once for the whole batch, then frame the records
                with torch.cuda.stream(self._side):
                    encs = [self._encode_slot(e) for _, e in batch]
                    self._side.synchronize()
            else:
                encs = [self._encode_slot(e) for _, e in batch]
            recs = [None if enc is None else self._l2_record(pack_block(*enc)) for enc in encs]
            with self._tier_lock:
                for (t, e), rec in zip(batch, recs):
                    with self._lock:
                        # another entry of the same content was copied below meanwhile
                        # (shared block, or its write-through to L3): nothing to write
                        clean = e.clean
                    ok = rec is not None and (clean or self.l2.put(e.tkey, rec))
                    with self._lock:
                        if rec is not None and ok:
                            if clean:
                                self.c["evicted_clean"] += 1
                            else:
                                e.l2 = True
                                e.l2_bytes = len(rec)
                                self.c["copies_l2"] += 1
                                self.c["bytes_l2"] += len(rec)
                                self.c["swap_out_l2_bytes"] += len(rec)
                                self.c["swap_out_blocks"] += 1
                                self.c["evicted_dirty"] += 1
                            if not e.cancel and e.slot is not None:
                                self.l1.delete(e.key)
                                t.free_slot(e)
                                self._home["l1"] -= 1
                                self._home[e.home] += 1  # l2, or l3 for a block clean there
                        elif rec is not None:
                            self.c["evict_failed"] += 1
                        e.pending = False
                        e.cancel = False
                        t.pending -= 1
                        done += 1
        finally:
            if done < len(batch):
                with self._lock:
                    for t, e in batch[done:]:
                        if e.pending:
                            e.pending = False
                            e.cancel = False
                            t.pending -= 1
            if batch:
                self._lat_out.add((time.perf_counter() - t0) / len(batch))

    def _encode_slot(self, e: BlockEntry):
        """(K, V) encodings of a pending block's slot, on the host (pinned, copy in flight on CUDA)."""
        slot = e.slot
        if slot is None or e.key not in self._by_key:
            return None
        if e.fence is not None:
            self._side.wait_event(e.fence)
        block = self.l1.pool[slot]  # [2, kv_heads, block_tokens, head_dim]
        return self._encode_pair(block, "l2")

    def _encode_pair(self, block: torch.Tensor, tier: str):
        kc, vc = self._codecs[tier]
        ek = kc.encode(block[0])  # [kv_heads, block_tokens, head_dim]
        ev = vc.encode(block[1])
        if ek.device.type != "cpu":
            ek, ev = _to_pinned(ek), _to_pinned(ev)
        with self._lock:
            self.c["raw_" + tier] += block.numel() * block.element_size()
            self.c["enc_" + tier] += ek.nbytes + ev.nbytes
        return ek, ev

    def _encode(self, block: torch.Tensor, tier: str) -> bytes:
        """One block as one record (host tensors only: no pending copies)."""
        assert block.device.type == "cpu", "records are framed from host tensors"
        return pack_block(*self._encode_pair(block, tier))

    def _l2_record(self, raw: bytes) -> bytes:
        """A block record as L2 holds it: through the byte stage when ``byte_stage_l2``."""
        if not self._l2_staged:
            return raw
        packed = self._stage.pack(raw)
        self._count(stage_in=len(raw), stage_out=len(packed))
        return packed

    def _decode(self, buf, tier: str, device: torch.device) -> torch.Tensor:
        """Record -> [2, kv_heads, block_tokens, head_dim] in the store dtype on ``device``."""
        if device.type == "cpu" and tier in self._fast_decoders:
            out = self._fast_decoders[tier].decode(buf)  # CRC-checked, parts read in place
            if out is not None:
                return out
        ek, ev = unpack_block(buf)
        kc, vc = self._codecs[tier]
        k = kc.decode(ek, device=device)
        v = vc.decode(ev, device=device)
        return torch.stack((k, v)).to(self.dtype)

    def _spill(self, items: list) -> None:
        """HostTier callback, called under ``_tier_lock``: the oldest L2 records go to L3.

        On success the ring drops every record of the batch. If L3 refuses some (full even after
        reclaiming unreferenced content records) this raises and the ring keeps them all: the
        ones that did land are then in both tiers, and the accounting says so.
        """
        out, already = [], []
        for key, mv in items:
            with self._lock:
                rec = self._recs.get(key)
            if rec is None:
                continue  # dropped meanwhile: nothing to keep
            if rec.l3:
                already.append(rec)  # written through (content key) or landed in a failed batch
                continue
            raw = bytes(mv)
            if self._l2_staged and not self._transcode:
                packed = raw  # already through the stage L3 uses: spilled as it is
            else:
                if self._l2_staged:
                    raw = self._stage.unpack(raw)
                if self._transcode:
                    raw = self._encode(self._decode(raw, "l2", torch.device("cpu")), "l3")
                packed = self._stage.pack(raw)
                self.c["stage_in"] += len(raw)
                self.c["stage_out"] += len(packed)
            out.append((key, rec, packed))
        oks = self._l3_put([(k, p) for k, _, p in out]) if out else []
        with self._lock:
            for (key, rec, packed), ok in zip(out, oks):
                if ok:
                    rec.l3 = True
                    rec.l3_bytes = len(packed)
                    self.c["copies_l3"] += 1
                    self.c["bytes_l3"] += len(packed)
                    self.c["swap_out_l3_bytes"] += len(packed)
            if all(oks):
                for rec in [r for _, r, _ in out] + already:
                    rec.wt = False  # L3 now holds the spill: the block's copy below L1
                    self._leave_l2(rec)
        if not all(oks):
            raise RuntimeError(f"L3 refused {oks.count(False)} of {len(oks)} spilled blocks (disk_bytes full)")

    def _leave_l2(self, rec: BlockCopies) -> None:
        """The ring dropped ``rec``'s L2 copy after a spill; L3 is now the home of its
        non-resident entries (lock held)."""
        if not rec.l2:
            return
        for e in rec.entries:
            if e.slot is None:
                self._home["l2"] -= 1
                self._home["l3"] += 1
        rec.l2 = False
        self.c["copies_l2"] -= 1
        self.c["bytes_l2"] -= rec.l2_bytes
        rec.l2_bytes = 0

    def _l3_put(self, items: list) -> list[bool]:
        """``l3.put_many``; when L3 is full, unreferenced content records (left by drops with
        ``keep_prefix`` or by earlier processes) are reclaimed and the refused puts retried once
        (tier lock held)."""
        oks = self.l3.put_many(items)
        if not all(oks) and self._reclaim_orphans():
            redo = [i for i, ok in enumerate(oks) if not ok]
            for i, ok in zip(redo, self.l3.put_many([items[i] for i in redo])):
                oks[i] = ok
        return oks

    def _reclaim_orphans(self) -> int:
        """Delete L3 content records no live block references (tier lock held)."""
        with self._lock:
            orphans = [k for k in self.l3.keys() if k not in self._recs and CONTENT_KEY.fullmatch(k)]
        if orphans:
            self.l3.delete_many(orphans)
            self._count(orphans_deleted=len(orphans))
        return len(orphans)

    # -- write-through of content-addressed blocks (publisher thread) -------------------------

    def _publish_batch(self, batch: list) -> None:
        """Encode new content-addressed blocks in the disk format (byte stage) and put them to
        L3 (reuse after restart) and L4 (sharing across processes) in one batch each."""
        todo = []
        for rec, data in batch:
            with self._lock:
                live = self._recs.get(rec.key) is rec
                need = (self.l3 is not None and not rec.l3) or (self.l4 is not None and not rec.l4)
            if not (live and need):
                continue
            raw = self._encode(data.to("cpu"), "l3")  # data: [2, kv_heads, block_tokens, head_dim]
            packed = self._stage.pack(raw)
            self._count(stage_in=len(raw), stage_out=len(packed))
            todo.append((rec, packed))
        if not todo:
            return
        if self.l3 is not None:
            with self._tier_lock:
                with self._lock:  # a spill may have put some meanwhile
                    put3 = [(r, p) for r, p in todo if not r.l3 and self._recs.get(r.key) is r]
                oks = self._l3_put([(r.key, p) for r, p in put3]) if put3 else []
                stale = []
                with self._lock:
                    for (rec, p), ok in zip(put3, oks):
                        if not ok:
                            self.c["pub_l3_failed"] += 1
                        elif self._recs.get(rec.key) is not rec:
                            stale.append(rec.key)  # dropped while being written
                        else:
                            rec.l3 = rec.wt = True
                            rec.l3_bytes = len(p)
                            self.c["copies_l3"] += 1
                            self.c["bytes_l3"] += len(p)
                            self.c["pub_l3_blocks"] += 1
                            self.c["pub_l3_bytes"] += len(p)
                if stale:
                    self.l3.delete_many(stale)
        if self.l4 is not None:
            put4 = [(r, p) for r, p in todo if not r.l4]
            oks = self.l4.put_many([(r.key, p) for r, p in put4])  # a dead server: all False
            with self._lock:
                for (rec, p), ok in zip(put4, oks):
                    if ok:
                        rec.l4 = True
                        self.c["pub_l4_blocks"] += 1
                        self.c["pub_l4_bytes"] += len(p)
                    else:
                        self.c["pub_l4_failed"] += 1

    # -- swap-in ------------------------------------------------------------------------------

    def _load(self, e: BlockEntry, device: torch.device | None = None) -> torch.Tensor:
        """Read a non-resident block from L2, L3 or L4 and decode it on the device."""
        device = self.device if device is None else device
        t0 = time.perf_counter()
        for _ in range(8):  # a spill may move the copy between reading the flags and the get
            out = self._load_copies(e.rec, device)
            if out is not None:
                break
        else:
            raise AssertionError(f"block {e.key} has no readable copy in any tier ({e}, {e.rec})")
        with self._lock:
            self.c["swap_in_blocks"] += 1
            self._lat_in.add(time.perf_counter() - t0)
        return out

    def _load_copies(self, rec: BlockCopies, device: torch.device) -> torch.Tensor | None:
        """One pass over ``rec``'s copies, nearest first; None when none could be read."""
        with self._lock:
            l2, l3, l4, key = rec.l2, rec.l3, rec.l4, rec.key
        if l2:
            with self._tier_lock:
                buf = self.l2.get(key)
            if buf is not None:
                out = self._decode(self._stage.unpack(buf) if self._l2_staged else buf, "l2", device)
                self._count(hits_l2=1, swap_in_l2_bytes=len(buf))
                return out
            self._count(misses_l2=1)
        if l3:
            with self._tier_lock:
                buf = self.l3.get(key)
            if buf is not None:
                out = self._decode(self._stage.unpack(buf), "l3", device)
                self._count(hits_l3=1, swap_in_l3_bytes=len(buf))
                return out
            self._count(misses_l3=1)
        if l4:
            buf = self.l4.get(key)
            out = self._decode_l3(buf)
            if out is not None:
                self._count(hits_l4=1, swap_in_l4_bytes=len(buf))
                return out
            self._count(misses_l4=1)
        return None

    def _count(self, **deltas: int) -> None:
        """Counter updates from more than one thread (caller and prefetch) go through the lock."""
        with self._lock:
            for k, d in deltas.items():
                self.c[k] += d

    def _fetch(self, e: BlockEntry) -> torch.Tensor:
        """A non-resident block's data: from the prefetch buffer if there, else a synchronous load."""
        fut = self._pf.pop(e.key, None)
        if fut is not None:
            try:
                data = fut.result()
                self._count(pf_used=1)
                self._pf_outcome(fut, True)
                return data
            except Exception:  # a failed prefetch is retried synchronously, and counted
                self._count(pf_wasted=1, pf_errors=1)
        return self._load(e)

    def _install(self, t: BlockTable, e: BlockEntry, data: torch.Tensor, exclude, scratch: list,
                 run: frozenset | None = None) -> int:
        """Give a swapped-in block an L1 slot: its own if the budget allows (dropping a clean
        block outside ``exclude`` if needed), else a scratch slot listed in ``scratch``.
        ``run``: the entries of a gather_view (the open block included): the block is placed
        straight into that run's span of the region when possible (``_run_position``)."""
        with self._lock:
            if e.slot is not None:
                return e.slot
            if t.resident >= self.hot_blocks:
                for b in self.policy.victims(t, 1, exclude, only_clean=True):
                    self._free_clean(t, t.entries[b])
            if t.resident < self.hot_blocks:
                self._home[e.home] -= 1
                pos = self._run_position(t, run) if run is not None else None
                self._alloc_in(t, e, data, pos=pos)
                self._home["l1"] += 1
                return e.slot
            assert len(scratch) < max(1, self.hot_blocks - 1), "more scratch blocks than the L1 budget"
            key = f"scratch/{next(self._scratch_ids)}"
            slot = self._alloc(key, data)
            scratch.append(key)
            self.c["scratch_uses"] += 1
            return slot

    def _run_position(self, t: BlockTable, run: frozenset) -> int | None:
        """A region position in ``[0, len(run) - 1)`` (where gather_view wants the selected
        blocks) for a block being swapped in: a free one, else one whose block is not in ``run``
        after moving that block to a free position past the run (one slot copy, instead of two
        or a swap when gather_view rearranges later). None: no such position (lock held)."""
        nsel = len(run) - 1
        at = t.at
        for p in range(nsel):
            if at[p] is None:
                return p
        f = t.free_position(nsel + 1)
        if f is None:
            return None
        for p in range(nsel):
            y = at[p]
            if y not in run and not y.pending:
                self._move(t, y, t.base + f, t.entries[-1])
                self.c["region_moves"] += 1
                return p
        return None

    # -- prefetch ------------------------------------------------------------------------------

    def _pf_outcome(self, fut: Future, used: bool) -> None:
        src = fut.kvtier_source
        with self._lock:
            self._pf_outcomes[src].append(used)
            self._pf_stats[src]["used" if used else "wasted"] += 1

    def _pf_allowed(self, src: str) -> bool:
        """Whether predictor ``src`` may issue now (caller holds _pf_lock)."""
        out = self._pf_outcomes[src]
        if len(out) < _PF_WINDOW // 2 or sum(out) >= _PF_MIN_PRECISION * len(out):
            return True
        self._pf_skipped[src] += 1
        return self._pf_skipped[src] % _PF_PROBE == 0  # keep measuring it

    def _discard_prefetch(self, fut: Future) -> None:
        """An unused prefetch: cancel it, or wait for it so no load of a dropped block is in flight."""
        self._count(pf_wasted=1)
        self._pf_outcome(fut, False)
        if not fut.cancel() and fut.exception() is not None:
            self._count(pf_errors=1)

    def _prefetch(self, t: BlockTable, blocks, src: str) -> None:
        """Decode the non-resident ``blocks`` of ``t`` in the background (predictor ``src``)."""
        ents = t.entries
        n = len(ents) - 1
        dropped = []
        with self._pf_lock:
            for b in blocks:
                if b >= n:
                    continue
                e = ents[b]
                if e.slot is not None or e.key in self._pf:
                    continue
                if not self._pf_allowed(src):
                    self._pf_stats[src]["throttled"] += 1
                    continue
                while len(self._pf) >= self.cfg.prefetch_blocks:
                    dropped.append(self._pf.popitem(last=False)[1])
                fut = self._pf_pool.submit(self._load, e)
                fut.kvtier_source = src
                self._pf[e.key] = fut
                self.c["pf_issued"] += 1
                self._pf_stats[src]["issued"] += 1
        for old in dropped:
            self._discard_prefetch(old)

    # -- reads -------------------------------------------------------------------------------

    def gather(self, seq: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense read: every token in order, K and V [kv_heads, T, head_dim] on the device.

        Blocks below L1 are swapped in (made resident while the budget has room, otherwise only
        streamed into the output); the next layer's missing blocks are prefetched meanwhile.
        """
        t = self._table(seq, layer)
        n = len(t.entries)
        kvh, bt, hd = self.kv_heads, self.block_tokens, self.head_dim
        if n == 0:
            empty = torch.empty(kvh, 0, hd, dtype=self.dtype, device=self.device)
            return empty, empty.clone()
        step = self._step
        res_i, res_s, miss = [], [], []
        with self._lock:
            for e in t.entries:
                e.last_used = step
                if e.slot is None:
                    miss.append(e)
                else:
                    res_i.append(e.idx)
                    res_s.append(e.slot)
                    if e.pending:
                        # being read: the worker keeps the slot after its copy (it is then clean,
                        # and the next end_step frees it without a write)
                        e.cancel = True
        self.c["hits_l1"] += len(res_i)
        self.c["misses_l1"] += len(miss)
        full = torch.empty(2, kvh, n, bt, hd, dtype=self.dtype, device=self.device)
        # residents first: a swap-in below may take a slot just freed by the worker
        if res_i:
            full.index_copy_(2, torch.tensor(res_i, device=self.device),
                             self._pool_kv.index_select(2, torch.tensor(res_s, device=self.device)))
        for e in miss:
            data = self._fetch(e)  # [2, kv_heads, block_tokens, head_dim]
            full[:, :, e.idx] = data
            with self._lock:
                if e.slot is None and t.resident < self.hot_blocks:
                    self._home[e.home] -= 1
                    self._alloc_in(t, e, data)
                    self._home["l1"] += 1
        if self._pf_pool is not None:
            # streaming: the next layer's missing blocks decode while this layer computes
            if layer + 1 < self.num_layers:
                self._prefetch(self._tables[seq][layer + 1], range(n), "dense_next_layer")
            self._dense_seqs.add(seq)
        self._touched[id(t)] = t
        kv = full.view(2, kvh, n * bt, hd)[:, :, : t.length]  # [2, kv_heads, T, head_dim]
        return kv[0], kv[1]

    def select(self, seq: int, layer: int, query: torch.Tensor, budget_tokens: int | None = None) -> list[int]:
        """Sealed blocks to attend: sinks + recent window + top-k by key digest (centroid or Quest bound).

        Args:
            query: [q_heads, q_len, head_dim], q_heads a multiple of kv_heads (GQA groups
                consecutive query heads per kv head, as transformers' ``repeat_kv``).
            budget_tokens: tokens to attend, the open block included (default: the config's).
        Returns:
            Sorted block indices.
        """
        if self._digest_score is None:
            raise ValueError(f"select() needs attention='sparse' (key digests are kept only in sparse "
                             f"mode); this store's config has attention={self.cfg.attention!r}")
        t = self._table(seq, layer)
        bt = self.block_tokens
        budget = self.budget_tokens if budget_tokens is None else budget_tokens
        if budget > self.hot_blocks * bt or budget < bt:
            raise ValueError(f"budget_tokens must be in [{bt}, {self.hot_blocks * bt}]; got {budget}")
        ns = t.n_sealed
        nb = budget // bt - 1
        if ns <= nb:
            sel = list(range(ns))
        else:
            s_end = min(self.sink_blocks, nb)
            w_start = max(s_end, ns - min(self.window_blocks, nb - s_end))
            k = nb - s_end - (ns - w_start)
            sel = list(range(s_end))
            if k > 0:
                if self._cscore:
                    # scores and selection in one compiled call, already ascending
                    top = cscore.top_blocks(self._query_f32(query), t.digest, s_end, w_start,
                                            self._digest_score == "quest", self.head_dim ** -0.5, k,
                                            self._digest_parts)
                    sel += [b + s_end for b in top]
                else:
                    scores = self._scores(t, query, s_end, w_start)
                    top = torch.topk(scores, k, sorted=False).indices.tolist()
                    sel += sorted(b + s_end for b in top)
            sel += range(w_start, ns)
        self._last_sel[(seq, layer)] = sel
        if self._pf_pool is not None and layer + 1 < self.num_layers:
            # next-layer prediction: adjacent layers attend to similar blocks
            self._prefetch(self._tables[seq][layer + 1], sel, "next_layer")
        return sel

    def _query_f32(self, query: torch.Tensor) -> torch.Tensor:
        """Checked query [q_heads, q_len, head_dim] as contiguous float32 on the device."""
        qh, ql, hd = query.shape
        if qh % self.kv_heads or hd != self.head_dim:
            raise ValueError(f"query must be [q_heads (multiple of {self.kv_heads}), q_len, {self.head_dim}]; "
                             f"got {tuple(query.shape)}")
        if query.dtype != torch.float32 or query.device != self.device:
            query = query.to(self.device, torch.float32)
        return query if query.is_contiguous() else query.contiguous()

    def _query_rows(self, query: torch.Tensor) -> torch.Tensor:
        """Checked query -> float32 [kv_heads, G*q_len, head_dim]: GQA groups consecutive query
        heads per kv head, so the rows of one kv head are adjacent (a view, no copy)."""
        return self._query_f32(query).view(self.kv_heads, -1, self.head_dim)

    def _scores(self, t: BlockTable, query: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Score of each sealed block in [lo, hi) against ``query`` (higher = attend); see
        ``KVTierConfig.select_score``. The torch math: the specification of cscore.py's CPU path."""
        q = self._query_rows(query)  # [kv_heads, G*q_len, hd]
        hd = self.head_dim
        dig_t = t.digest_t(lo, hi)  # [kv_heads, hd, m] (mean) or [kv_heads, 2*hd, m] (max | min)
        if dig_t.dtype != torch.float32:
            dig_t = dig_t.float()
        if self._digest_score == "centroid":
            # bmm and scale in one op (beta=0: the [1, 1, 1] zeros are never read)
            s = torch.baddbmm(self._zeros111, q, dig_t, beta=0.0, alpha=hd ** -0.5)  # [kv_heads, G*q_len, m*parts]
            best = torch.softmax(s, dim=-1).amax(dim=(0, 1))  # [m*parts]: best query of the best head
            p = self._digest_parts
            return best if p == 1 else best.view(-1, p).amax(dim=1)  # [m]: the block's best sub-block
        # Quest: q_d*max_d where q_d >= 0, q_d*min_d where q_d < 0: one bmm against [max | min]
        qq = torch.cat((q.clamp(min=0), q.clamp(max=0)), dim=-1)  # [kv_heads, G*q_len, 2*hd]
        s = torch.bmm(qq, dig_t)  # [kv_heads, G*q_len, m]
        return s.amax(dim=1).sum(dim=0)  # [m]

    def _prepare(self, seq: int, layer: int, blocks, view: bool = False
                 ) -> tuple[BlockTable, list[int], list[int], list[str]]:
        """Checks and swap-ins shared by gather_blocks and gather_view: every block of ``blocks``
        resident (a region slot, or a scratch slot listed in the returned ``scratch`` when the
        region is full), counted as a hit or a miss, and marked used.

        Returns:
            (table, blocks as a list, L1 slot per block with the open block's last, scratch keys)
        """
        t = self._table(seq, layer)
        ents = t.entries
        ns = len(ents) - 1
        if ns < 0:
            raise ValueError(f"sequence {seq} layer {layer} is empty")
        blocks = list(blocks)
        nsel = len(blocks)
        if nsel >= self.hot_blocks:
            raise ValueError(f"blocks must number at most {self.hot_blocks - 1} (the L1 budget less the "
                             f"open block); got {nsel}")
        for b in blocks:
            if not 0 <= b < ns:
                raise ValueError(f"blocks must be sealed block indices in [0, {ns}); got {b}")
        step = self._step
        slots = [0] * (nsel + 1)
        scratch: list[str] = []
        in_scratch: set[int] = set()
        c = self.c
        for attempt in range(8):
            miss = []
            with self._lock:
                for i, b in enumerate(blocks):
                    e = ents[b]
                    e.last_used = step
                    if e.slot is None:
                        if i not in in_scratch:
                            miss.append((i, e))
                    else:
                        slots[i] = e.slot
                        if e.pending:
                            e.cancel = True  # it is being attended: keep the slot after its copy
                e = ents[-1]
                slots[-1] = e.slot
                e.last_used = step
            if attempt == 0:
                c["hits_l1"] += nsel - len(miss)
            c["misses_l1"] += len(miss)
            if not miss:
                break
            sel = frozenset(blocks)
            run = frozenset([ents[b] for b in blocks] + [ents[-1]]) if view else None
            for i, e in miss:
                before = len(scratch)
                slots[i] = self._install(t, e, self._fetch(e), sel, scratch, run)
                if len(scratch) > before:
                    in_scratch.add(i)
            # Another thread's end_step may have freed a block counted as a hit above, and an
            # install here may then have reused its region slot: read the slots again until
            # every block is where it was seen (no install in the last pass).
            with self._lock:
                if all(i in in_scratch or ents[b].slot == slots[i] for i, b in enumerate(blocks)):
                    break
        else:
            raise AssertionError(f"{t.seq}/{t.layer}: selected blocks kept leaving L1 during a gather")
        self._touched[id(t)] = t
        return t, blocks, slots, scratch

    def gather_blocks(self, seq: int, layer: int, blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V of ``blocks`` (sorted sealed indices) followed by the open block, copied out of L1.

        The decode path uses :meth:`gather_view` (no copy); this keeps the order of ``blocks``.

        Returns:
            K, V: [kv_heads, n, head_dim] (owned: copied out of the pool); pos: LongTensor [n] of
            the token positions.
        """
        t, blocks, slots, scratch = self._prepare(seq, layer, blocks)
        blocks.append(len(t.entries) - 1)
        return self._gather_copy(t, slots, blocks, scratch)

    def _gather_copy(self, t: BlockTable, slots: list[int], blocks: list[int],
                     scratch: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V [kv_heads, n, head_dim] and pos [n] of ``blocks`` (the open block last) at
        ``slots``, in that order, copied out of the pool; frees the ``scratch`` slots."""
        idx, pos = self._gather_index(t, slots, blocks)
        bt = self.block_tokens
        n = len(blocks)
        total = (n - 1) * bt + (t.length - (len(t.entries) - 1) * bt)
        g = self._pool_kv.index_select(2, idx)  # [2, kv_heads, n, bt, hd]
        if scratch:
            with self._lock:
                for key in scratch:
                    self.l1.delete(key)
        kv = g.view(2, self.kv_heads, n * bt, self.head_dim)  # [2, kv_heads, n*bt, hd]
        if total < n * bt:
            kv = kv.narrow(2, 0, total)
            pos = pos[:total]
        k, v = kv.unbind(0)
        return k, v, pos.clone()  # the cached positions stay untouched whatever the caller does

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
        blocks = list(blocks)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"blocks must be distinct; got {sorted(blocks)}")
        t, blocks, slots, scratch = self._prepare(seq, layer, blocks, view=True)
        ents = t.entries
        nsel = len(blocks)
        ok = False
        n = nsel + 1
        if not scratch:
            with self._lock:  # another thread's end_step may free a block of the run right after
                ok = self._arrange(t, [ents[b] for b in blocks], ents[-1])
                order = [e.idx for e in t.at[:n]] if ok else None
        if not ok:
            self.c["gather_copies"] += 1
            blocks.append(len(ents) - 1)
            k, v, pos = self._gather_copy(t, slots, blocks, scratch)
            return k, v, pos, blocks
        self.c["gather_views"] += 1
        t.view_n = n
        bt = self.block_tokens
        cached = t.view_cache
        if cached is not None and cached[0] == order:
            pos = cached[1]
        else:
            rows = np.asarray(order, dtype=np.int64)[:, None] * bt + self._np_arange_bt  # [n, bt]
            pos = torch.from_numpy(rows.ravel()).to(self.device)
            t.view_cache = (order[:], pos)  # a copy: the caller owns the returned list
        if t.run_kv is None:
            # the whole region per plane and head as one run of tokens (the storage never moves)
            t.run_kv = self._pool_kv[:, :, t.base:t.base + t.cap].view(
                2, self.kv_heads, t.cap * bt, self.head_dim).unbind(0)  # 2 x [kv_heads, cap*bt, hd]
        total = nsel * bt + (t.length - (len(ents) - 1) * bt)  # the open block's unused tail is past the end
        k_run, v_run = t.run_kv
        return k_run.narrow(1, 0, total), v_run.narrow(1, 0, total), pos.narrow(0, 0, total), order

    def _arrange(self, t: BlockTable, sel: list[BlockEntry], open_e: BlockEntry) -> bool:
        """Lay ``t``'s region out for a view (lock held): the entries ``sel`` at positions
        ``[0, len(sel))`` in any order, ``open_e`` at ``len(sel)``; False, moving nothing, if a
        block that would move (in or out of that run) is pending (the worker reads its slot).

        ```
         before  [a][x][b][open][c][ ][y]     sel = {a, b, c}, nsel = 3
         plan    c -> 1 (hole: x is not selected); x -> 5 (free, past the run)
         after   [a][c][b][open][ ][x][y]     two block copies
        ```
        Moves go to free positions first (one copy each); a cycle with no free position left
        is broken by a swap (three copies).
        """
        nsel = len(sel)
        base, cap, at = t.base, t.cap, t.at
        if any(e.slot is None for e in sel):
            # freed since _prepare by another thread's end_step (its data stays until this
            # table allocates again): this step reads the slots _prepare saw
            return False
        movers = [e for e in sel if not 0 <= e.slot - base < nsel]
        if not movers and open_e.slot - base == nsel:
            return True  # steady state: the run is already in place
        for e in movers:
            if not 0 <= e.slot - base < cap:
                return False  # not in the region (cannot happen without scratch; kept safe)
        wanted = set(sel)
        holes = [p for p in range(nsel) if at[p] is None or at[p] not in wanted]
        assert len(holes) == len(movers), f"{len(holes)} holes for {len(movers)} blocks"
        plan = dict(zip(movers, holes))  # entry -> target region position
        if open_e.slot - base != nsel:
            plan[open_e] = nsel
        evict = [at[p] for p in plan.values() if at[p] is not None and at[p] not in plan]
        if evict:
            # past the run: free positions first (one copy each), then those planned entries leave
            dest = [p for p in range(nsel + 1, cap) if at[p] is None]
            dest += [p for p in range(nsel + 1, cap) if at[p] is not None and at[p] in plan]
            assert len(dest) >= len(evict), f"region of {t.seq}/{t.layer} over-full: {t.resident} > {cap}"
            plan.update(zip(evict, dest))
        if any(e.pending for e in plan):
            return False
        open_slot = open_e.slot
        moves = 0
        while plan:
            progress = False
            for e, p in list(plan.items()):
                if at[p] is None:
                    self._move(t, e, base + p, open_e)
                    del plan[e]
                    moves += 1
                    progress = True
            if progress:
                continue
            # only cycles left: every target is held by another planned entry
            e, p = next(iter(plan.items()))
            f = t.free_position()
            if f is not None:  # step aside into a free position: the cycle becomes a chain
                self._move(t, e, base + f, open_e)
                moves += 1
                continue
            y = at[p]
            ok = self.l1.swap(e.key, y.key)
            assert ok, f"region slots {e.slot} and {y.slot} refused a swap"
            t.swap_positions(e, y)
            moves += 3
            del plan[e]
            if plan.get(y) == y.slot - base:
                del plan[y]
        self.c["region_moves"] += moves
        if open_e.slot != open_slot:
            self._open_views(t)  # appends write through views of the open block's slot
        return True

    def _move(self, t: BlockTable, e: BlockEntry, slot: int, open_e: BlockEntry) -> None:
        """Move ``e`` to the free region slot ``slot`` (lock held). The open block copies only its
        filled tokens: it moves right after a seal, when it holds one or a few."""
        old = e.slot
        whole = e is not open_e
        ok = self.l1.move(e.key, slot, copy=whole)
        assert ok, f"region slot {slot} refused although free"
        if not whole:
            fill = t.length - (len(t.entries) - 1) * self.block_tokens
            pool = self.l1.pool
            pool[slot, :, :, :fill] = pool[old, :, :, :fill]  # [2, kv_heads, fill, head_dim]
        t.relocate(e, slot)

    def _gather_index(self, t: BlockTable, slots: list[int], blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool slots as an index tensor [n] and the token positions of ``blocks`` [n * bt] (the
        open block counted in full), both on the device.

        Adjacent decode steps mostly attend to the same blocks (same slots: sealed blocks never
        change), so the pair is kept per table and reused while the selection and slots stay the
        same (about half of the steps in bench_store). Both are pure functions of the two lists.
        """
        cached = t.gather_cache
        if cached is not None and cached[0] == slots and cached[1] == blocks:
            return cached[2], cached[3]
        # token positions: block b covers [b*bt, (b+1)*bt); built in numpy (one torch op less per
        # index than torch.tensor + arithmetic), moved to the device in one copy
        rows = np.asarray(blocks, dtype=np.int64)[:, None] * self.block_tokens + self._np_arange_bt
        if self.device.type == "cpu":
            idx = torch.from_numpy(np.array(slots, dtype=np.int64))
            pos = torch.from_numpy(rows.ravel())
        else:
            n = len(slots)
            both = torch.from_numpy(np.concatenate((np.array(slots, dtype=np.int64), rows.ravel())))
            both = both.to(self.device)
            idx, pos = both[:n], both[n:]
        t.gather_cache = (slots, blocks, idx, pos)
        return idx, pos

    # -- attention feedback ----------------------------------------------------------------------

    def observe(self, seq: int, layer: int, blocks, mass) -> None:
        """Accumulate attention mass per gathered block (h2o); the first
        ``snapkv_observe_steps`` observations also form the snapkv importance.

        Args:
            blocks: the block indices passed to ``gather_blocks`` (or every sealed block in dense mode).
            mass: [len(blocks)] or [len(blocks) + 1] (the last one for the open block).
        """
        t = self._table(seq, layer)
        m = mass.tolist() if isinstance(mass, torch.Tensor) else list(mass)
        blocks = list(blocks)
        if len(m) not in (len(blocks), len(blocks) + 1):
            raise ValueError(f"mass must have len(blocks) or len(blocks)+1 entries; got {len(m)} for "
                             f"{len(blocks)} blocks")
        if len(m) == len(blocks) + 1:
            blocks.append(len(t.entries) - 1)
        ents = t.entries
        t.observed += 1
        snap = t.observed <= self.cfg.snapkv_observe_steps
        for b, x in zip(blocks, m):
            e = ents[b]
            e.mass += x
            if snap:
                e.importance += x

    def observe_queries(self, seq: int, layer: int, query: torch.Tensor) -> None:
        """SnapKV voting: attention of ``query`` (the observation window at the end of prefill,
        [q_heads, w, head_dim]) over every token, pooled per block, fed to :meth:`observe`."""
        k, _ = self.gather(seq, layer)  # [kv_heads, T, hd]
        qh, w, hd = query.shape
        g = qh // self.kv_heads
        q = query.to(k.device, torch.float32).reshape(self.kv_heads, g * w, hd)
        att = torch.softmax(q @ k.float().transpose(1, 2) / math.sqrt(hd), dim=-1)  # [kv_heads, g*w, T]
        per_tok = att.sum(dim=(0, 1))  # [T]
        nb = len(self._table(seq, layer).entries)
        pad = nb * self.block_tokens - per_tok.shape[0]
        per_block = torch.nn.functional.pad(per_tok, (0, pad)).view(nb, self.block_tokens).sum(1)
        self.observe(seq, layer, range(nb - 1), per_block)

    # -- stats ----------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Plain, JSON-serialisable dict of what the store holds and what it cost."""
        c = dict(self.c)
        bt = self.block_tokens
        tokens = resident = l1_tokens = digest_bytes = digest_reserved = 0
        with self._lock:
            home = dict(self._home)
            for tables in self._tables.values():
                for t in tables:
                    tokens += t.length
                    resident += t.resident
                    if t.entries:  # the open block holds length - sealed tokens, not block_tokens
                        l1_tokens += t.resident * bt - (len(t.entries) * bt - t.length)
                    if t.digest is not None:
                        digest_bytes += t.n_sealed * t.digest_row_bytes()
                        digest_reserved += t.digest.numel() * t.digest.element_size()
        # digests live on the L1 device next to the pool: they are part of L1's footprint
        l1_bytes = resident * self.slot_bytes + digest_bytes
        copies = {"l1": resident, "l2": c["copies_l2"], "l3": c["copies_l3"]}
        nbytes = {"l1": l1_bytes, "l2": c["bytes_l2"], "l3": c["bytes_l3"]}
        tok = {"l1": l1_tokens, "l2": c["copies_l2"] * bt, "l3": c["copies_l3"] * bt}
        pf_done = c["pf_used"] + c["pf_wasted"]
        return {
            "tokens": tokens,
            "sequences": len(self._tables),
            "blocks": home,
            "copies": copies,
            "bytes": nbytes,
            "digest_bytes": digest_bytes,
            "digest_reserved_bytes": digest_reserved,
            "bytes_per_token": {k: ratio(nbytes[k], tok[k]) for k in nbytes},
            "tier_used_bytes": {"l1": self.l1.used_bytes, "l2": self.l2.used_bytes,
                                "l3": self.l3.used_bytes if self.l3 is not None else 0},
            "hits": {"l1": c["hits_l1"], "l2": c["hits_l2"], "l3": c["hits_l3"], "prefetch": c["pf_used"]},
            "misses": {"l1": c["misses_l1"], "l2": c["misses_l2"], "l3": c["misses_l3"]},
            "swap_in_bytes": {"l2": c["swap_in_l2_bytes"], "l3": c["swap_in_l3_bytes"]},
            "swap_out_bytes": {"l2": c["swap_out_l2_bytes"], "l3": c["swap_out_l3_bytes"]},
            "swap_in_blocks": c["swap_in_blocks"],
            "swap_out_blocks": c["swap_out_blocks"],
            "evictions": {"clean": c["evicted_clean"], "dirty": c["evicted_dirty"],
                          "failed": c["evict_failed"], "sync": c["sync_evictions"]},
            "scratch_uses": c["scratch_uses"],
            # gather_view: steps served as views of L1, steps that fell back to a copy, and block
            # copies made to keep each table's attended run contiguous
            "gather": {"views": c["gather_views"], "copies": c["gather_copies"],
                       "moved_blocks": c["region_moves"]},
            "swap_in_latency": self._lat_in.summary(),
            "swap_out_latency": self._lat_out.summary(),
            "step_time": self._lat_step.summary(),
            "prefetch": {
                "enabled": self.prefetch,
                "issued": c["pf_issued"], "used": c["pf_used"], "wasted": c["pf_wasted"],
                "precision": ratio(c["pf_used"], pf_done),
                # None while off: no prefetch to have covered the misses (not a measured 0)
                "coverage": ratio(c["pf_used"], c["misses_l1"]) if self.prefetch else None,
                "by_source": {src: dict(v, precision=ratio(v["used"], v["used"] + v["wasted"]))
                              for src, v in self._pf_stats.items()},
            },
            "compression": {
                "host_codec": self.host_codec, "disk_codec": self.disk_codec,
                "l2_ratio": ratio(c["raw_l2"], c["enc_l2"]),
                "l3_ratio": ratio(c["raw_l3"], c["enc_l3"]) if self._transcode
                else ratio(c["raw_l2"], c["enc_l2"]),
                # the lossless stage as achieved (flag bytes included; records kept raw count 1.0)
                "byte_stage": self._stage.algorithm, "byte_stage_l2": self._l2_staged,
                "byte_stage_ratio": ratio(c["stage_in"], c["stage_out"]),
                "lz4_ratio": ratio(c["stage_in"], c["stage_out"]) if self._stage.algorithm == "lz4" else None,
            },
            "config": {"order": self.cfg.order, "policy": self.cfg.policy, "attention": self.cfg.attention,
                       "block_tokens": bt, "hot_blocks": self.hot_blocks, "budget_tokens": self.budget_tokens},
            "fingerprint": self.fingerprint,
            "prefix": self._prefix_stats(c),
            "remote": self._remote_stats(c),
        }

    def _prefix_stats(self, c: dict) -> dict:
        with self._lock:
            refs = [len(r.entries) for r in self._recs.values() if r.content]
        shared = [n for n in refs if n > 1]
        return {
            "lookups": c["prefix_lookups"], "lookup_tokens": c["prefix_lookup_tokens"],
            "hit_tokens": c["prefix_hit_tokens"], "prefill_tokens_saved": c["prefill_tokens_saved"],
            "content_blocks": len(refs), "shared_blocks": len(shared), "shared_refs": sum(shared),
            "max_refs": max(refs, default=0), "dedup_seals": c["dedup_seals"],
            "adopted_l3": c["adopted_l3"], "orphans_deleted": c["orphans_deleted"],
            "published_l3": {"blocks": c["pub_l3_blocks"], "bytes": c["pub_l3_bytes"],
                             "failed": c["pub_l3_failed"]},
        }

    def _remote_stats(self, c: dict) -> dict | None:
        if self.l4 is None:
            return None
        return {
            "hits": c["hits_l4"], "misses": c["misses_l4"], "swap_in_bytes": c["swap_in_l4_bytes"],
            "published_blocks": c["pub_l4_blocks"], "published_bytes": c["pub_l4_bytes"],
            "publish_failed": c["pub_l4_failed"],
            "tier": self.l4.stats(),  # puts, gets, bytes, errors, latency p50/p99 ms, connected
        }

    # -- lifecycle ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("KVStore is closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._worker.close()
            if self._publisher is not None:
                self._publisher.close()
        finally:
            if self.l4 is not None:
                self.l4.close()
            if self._pf_pool is not None:
                for fut in self._pf.values():
                    fut.cancel()
                self._pf_pool.shutdown(wait=True)
            self._pf.clear()
            if self.l3 is not None:
                self.l3.close()
            self.l2.close()
            self.l1.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- sequence surgery: add many, truncate (crop), fork -------------------------------------
    # What kvtier.integrations needs for TieredCache.crop / fork / batch changes. Same locks as
    # everywhere: the tier lock before the state lock; nothing waits while holding either.

    @property
    def closed(self) -> bool:
        return self._closed

    def free_sequences(self) -> int:
        """How many more sequences may be registered now (``max_sequences`` less the live ones)."""
        return self.cfg.max_sequences - len(self._tables)

    def add_sequences(self, n: int) -> list[int]:
        """Register ``n`` new sequences, all or none.

        Raises:
            ValueError (registering nothing) when fewer than ``n`` are free.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0; got {n!r}")
        self._check_open()
        if n > self.free_sequences():
            raise ValueError(
                f"max_sequences ({self.cfg.max_sequences}) is too small: {n} more sequences wanted, "
                f"{len(self._tables)} live already (every batch row of every open cache on this store "
                f"is one; beams and num_return_sequences multiply the batch). Raise "
                f"KVTierConfig.max_sequences, or close caches you no longer use")
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
        """Cut every layer of ``seq`` that holds more than ``length`` tokens back to ``length``.

        ```
         before  [ b0 ][ b1 ][ b2 ][ b3 open ]      bt = block_tokens
         cut at length 1.5 bt:  b2, b3 leave every tier; b1 is reopened
         after   [ b0 ][ b1 open: bt/2 tokens ]
        ```
        Blocks past the cut lose this reference; their copies below L1 go once no other
        sequence holds them (content-addressed L3 copies stay for :meth:`match_prefix`, as with
        ``drop_sequence(keep_prefix=True)``). The block the cut falls in becomes the open block:
        kept in its L1 slot (full precision) when resident, otherwise decoded from its nearest
        copy into one, so with a lossy codec its kept tokens hold the codec's reconstruction,
        not the original values. Cut inside a block, that block gets private copies from now on
        (the next append makes it new content). Token ids noted for ``seq`` are cut too.
        """
        self._check_open()
        tables = self._tables.get(seq)
        if tables is None:
            raise ValueError(f"seq must be a live sequence id {sorted(self._tables)}; got {seq!r}")
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"length must be an int >= 0; got {length!r}")
        cut = [t for t in tables if t.length > length]
        if not cut:
            return
        self._quiesce(seq)
        bt = self.block_tokens
        keep = -(-length // bt)  # blocks left, the last one open
        for t in cut:
            drop2, drop3 = [], []
            reopen = keep and keep < len(t.entries)  # a sealed block becomes the open one
            with self._lock:
                for e in t.entries[keep:]:
                    self._unlink(t, e, drop2, drop3)
                del t.entries[keep:]
                t.length = min(t.length, keep * bt)
                self._last_sel.pop((seq, t.layer), None)
                t.gather_cache = t.view_cache = None
                t.view_n = 0
            fresh = None
            if reopen:
                e = t.entries[-1]
                if e.slot is None:
                    data = self._load(e)  # [2, kv_heads, block_tokens, head_dim]
                    self._make_room(t, 1, exclude=frozenset())
                    with self._lock:
                        self._home[e.home] -= 1
                        self._alloc_in(t, e, data)
                        self._home["l1"] += 1
                if length < keep * bt:
                    with self._lock:
                        self._unref(e, drop2, drop3)
                        fresh = BlockCopies(e.key)
            self._delete_copies(drop2, drop3)
            with self._lock:
                if fresh is not None:  # registered only now: its key may have named a dropped copy
                    e.rec = fresh
                    fresh.entries.append(e)
                    self._recs[e.key] = fresh
                t.length = length
                if t.entries:
                    self._open_views(t)
                else:
                    t.open_view = t.open_np = None
                self._touched[id(t)] = t
        st = self._tok.get(seq)
        if st is not None:
            st.truncate(length, bt)

    def fork_sequence(self, src: int) -> int:
        """A new sequence holding what ``src`` holds, sharing its sealed blocks.

        Each sealed block of the fork joins ``src``'s :class:`BlockCopies` (reference count + 1):
        stored once in every tier below L1, and a block not yet written below is written once for
        both. L1 stays per sequence: what is resident in ``src``'s region is copied into the new
        region at the same positions, the open block included (copy-on-write: later appends write
        only one sequence's open block). Digests, policy statistics and token ids are copied.

        Raises:
            ValueError when no sequence is free (``max_sequences``), registering nothing.
        """
        self._check_open()
        tables = self._tables.get(src)
        if tables is None:
            raise ValueError(f"src must be a live sequence id {sorted(self._tables)}; got {src!r}")
        dst = self.add_sequences(1)[0]
        try:
            with self._lock:
                for s, d in zip(tables, self._tables[dst]):
                    self._fork_table(s, d)
        except BaseException:
            self.drop_sequence(dst)
            raise
        st = self._tok.get(src)
        if st is not None:
            self._tok[dst] = st.copy()
        return dst

    def _fork_table(self, s: BlockTable, d: BlockTable) -> None:
        """Fill the empty table ``d`` from ``s`` (lock held): shared copies, own L1 slots."""
        src_slots, dst_slots = [], []
        last = len(s.entries) - 1
        for e in s.entries:
            n = BlockEntry(e.idx, block_key(d.seq, d.layer, e.idx))
            if e.idx < last:  # sealed: the same content, one more reference
                n.rec.entries.remove(n)
                n.rec = e.rec
                e.rec.entries.append(n)
            else:
                self._recs[n.key] = n.rec
            n.last_used, n.mass, n.importance = e.last_used, e.mass, e.importance
            d.entries.append(n)
            self._by_key[n.key] = n
            if e.slot is not None:
                slot = d.base + (e.slot - s.base)
                if not self.l1.put_at(n.key, slot, None):
                    raise AssertionError(f"fresh region slot {slot} of {d.seq}/{d.layer} refused")
                d.take_slot(n, slot)
                src_slots.append(e.slot)
                dst_slots.append(slot)
                self._home["l1"] += 1
            else:
                self._home[n.home] += 1
        if src_slots:
            src_i = torch.tensor(src_slots, device=self.device)
            self._pool_kv[:, :, torch.tensor(dst_slots, device=self.device)] = \
                self._pool_kv.index_select(2, src_i)  # [2, kv_heads, n, block_tokens, head_dim]
        d.length = s.length
        d.observed = s.observed
        if s.digest is not None:
            d.digest = s.digest.clone()
        if d.entries:
            self._open_views(d)
        self._touched[id(d)] = d

    def _quiesce(self, seq: int) -> None:
        """No swap-out, write-through or prefetch of ``seq`` in flight (before changing its blocks)."""
        self._worker.drain()
        if self._publisher is not None:
            self._publisher.drain()
        prefix = f"{seq}/"
        with self._pf_lock:
            mine = [self._pf.pop(k) for k in list(self._pf) if k.startswith(prefix)]
        for fut in mine:
            self._discard_prefetch(fut)

    def _unlink(self, t: BlockTable, e: BlockEntry, drop2: list, drop3: list) -> None:
        """Entry ``e`` leaves ``t``: its L1 slot and its reference (lock held)."""
        self._home[e.home] -= 1
        if e.slot is not None:
            self.l1.delete(e.key)
            t.free_slot(e)
        self._unref(e, drop2, drop3)
        self._by_key.pop(e.key, None)

    def _unref(self, e: BlockEntry, drop2: list, drop3: list) -> None:
        """Drop ``e``'s reference to its copies below L1; the last one lists them for deletion
        (content-addressed L3 copies are kept for later prefix matches). Lock held."""
        rec = e.rec
        rec.entries.remove(e)
        if not rec.entries:
            if self._recs.get(rec.key) is rec:
                del self._recs[rec.key]
            if rec.l2:
                drop2.append(rec.key)
            if rec.l3 and not rec.content:
                drop3.append(rec.key)

    def _delete_copies(self, drop2: list, drop3: list) -> None:
        if not (drop2 or drop3):
            return
        with self._tier_lock:
            self.l2.delete_many(drop2)
            if self.l3 is not None:
                self.l3.delete_many(drop3)
            with self._lock:
                self._recount()




def _to_pinned(enc):
    """A copy of ``enc`` in pinned host memory, enqueued on the current stream (not yet complete)."""
    from kvtier.compress.base import Encoded

    parts = {}
    for name, t in enc.parts.items():
        dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        dst.copy_(t, non_blocking=True)
        parts[name] = dst
    return Encoded(enc.codec, dict(enc.params), tuple(enc.shape), enc.dtype, parts)


class _SeqTokens:
    """Token ids noted for one sequence: the chained hash of every full block, and the tail."""

    __slots__ = ("hashes", "tail", "count", "ids")

    def __init__(self) -> None:
        self.hashes: list[str] = []
        self.tail = np.empty(0, dtype="<i8")
        self.count = 0
        self.ids: list[np.ndarray] = []  # every id noted, in chunks (truncate needs them back)

    def add(self, ids: np.ndarray, block_tokens: int, fp: str) -> None:
        tail = np.concatenate((self.tail, ids)) if self.tail.size else ids
        n_full = tail.size // block_tokens
        if n_full:
            self.hashes += chained_block_hashes(tail[:n_full * block_tokens], block_tokens, fp,
                                                parent=self.hashes[-1] if self.hashes else None)
        self.tail = tail[n_full * block_tokens:].copy()
        self.count += int(ids.size)
        self.ids.append(np.array(ids, dtype="<i8"))

    def truncate(self, n: int, block_tokens: int) -> None:
        """Forget every id past the first ``n`` (the hashes of whole blocks before stay valid)."""
        if n >= self.count:
            return
        kept = np.concatenate(self.ids)[:n] if self.ids else np.empty(0, dtype="<i8")
        self.ids = [kept]
        self.hashes = self.hashes[: n // block_tokens]
        self.tail = kept[(n // block_tokens) * block_tokens:].copy()
        self.count = n

    def copy(self) -> "_SeqTokens":
        other = _SeqTokens()
        other.hashes = list(self.hashes)
        other.tail = self.tail.copy()
        other.count = self.count
        other.ids = list(self.ids)  # chunks are never written after they are added
        return other
