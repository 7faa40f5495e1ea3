"""The worker's block store: vLLM's full KV blocks as kvtier records in L2, L3 and L4.

Nothing here imports vLLM: the connector (``connector.py``) hands it tensors and content
hashes, so this part runs (and is unit-testable) without an engine.

```
 save: save_kv_layer ─copy─► staged [n, H, 2, bs, hd] per layer ─queue─► encoder thread
                                   encode K, V (codec) ─► one block record per (block, layer)
                                   ─► L2 ring (HostTier), L3 segments (DiskTier), L4 (RemoteTier or MooncakeTier)
 load: keys ─► L2, else L3, else L4 (one batched round trip) ─► decode ─► vLLM's pages
```
A record's key is ``f"{fp}/{layer}/{block_hash}"``: ``block_hash`` is chained over the token
ids and vLLM's extra keys of the block and every block before it (``identity.py``), ``fp`` folds
in the engine's identity (checkpoint weights, KV config), the codecs and their parameters, the
block size, KV shape and the namespace, so two engines of the same weights, codec and namespace
find each other's blocks and nothing else.

Every record is written through to every configured tier (L3 so a restarted engine finds it,
L4 so another engine does); L2 is a DRAM cache of the newest records whose ring drops the
oldest when it wraps (they are still in L3/L4).

Why tiers and records, not ``KVStore``: under vLLM, vLLM owns L1 (its paged KV), scheduling and
eviction; ``KVStore`` is built around an L1 pool of its own, per-sequence block tables, policies
and sparse attention, and would need every token appended a second time just to seal blocks.
What the connector needs is kvtier's codecs, block record format (``store.blockrecord``, with
its in-place integer decoder), content keys (``store.prefix``) and tiers: this module composes
them, and ``KVStore`` is untouched.

Ownership: :meth:`BlockStore.save` takes the staged tensors (the caller must not reuse them);
:meth:`BlockStore.load` writes into the caller's ``pages`` and keeps nothing.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from dataclasses import dataclass, field

import torch

from kvtier.compress.codecs import IntCodec
from kvtier.config import LOSSLESS_CODECS, KVTierConfig, lossless_codec
from kvtier.store.blockrecord import BlockDecoder, pack_block, unpack_block
from kvtier.store.prefix import block_key, model_fingerprint_key
from kvtier.tiers import DiskTier, HostTier
from kvtier.tiers.remotes import open_remote

log = logging.getLogger(__name__)

# KVTierConfig fields the connector reads; the rest (L1 budget, policies, sparse attention)
# belong to kvtier's own cache and have no meaning under vLLM, which owns the device pages.
CONNECTOR_FIELDS = ("codec", "key_codec", "value_codec", "key_transform", "group_size", "key_axis", "value_axis",
                    "host_bytes", "disk_path",
                    "disk_bytes", "disk_segment_bytes", "durability", "remote_url", "remote_key_prefix",
                    "namespace")
_SAVE_QUEUE_JOBS = 8  # steps of staged KV waiting to be encoded before save_kv_layer blocks
# Redis round-trip bound. One step's save is a pipeline of (blocks x layers) records, MBs; under
# load (this 2-core machine at load 10) RemoteTier's 0.5 s default timed such puts out and marked
# the server down. The cost of a larger bound is a stall of the lookup when the server black-holes
# packets, once per outage (RemoteTier then serves misses without trying for retry_interval_s).
_REMOTE_TIMEOUT_S = 2.0


RAW = "raw"
CODEC_CHOICES = (RAW, "fp16", "bf16", "int8", "int4", "int2", "nf4", "fp4", "dyn8")


_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def stored_codec(name: str, dtype: torch.dtype) -> str:
    """The kvtier codec that stores a block of KV dtype ``dtype`` under connector codec ``name``:
    ``raw`` is the pass-through codec of that dtype (exact, the block as vLLM holds it; ``fp16``
    or ``bf16`` would round float32 KV to 16 bits), every other name is itself.

    The other 16-bit pass-through codec of a 16-bit KV dtype (``fp16`` for bfloat16 KV, ``bf16``
    for float16) is refused with ValueError when the connector is built: it would store the same
    bytes as ``raw`` and lose range (bfloat16 values past fp16's 65504 become inf) or precision
    (fp16's 3 more mantissa bits), and the codec refuses that input on every save."""
    if name in LOSSLESS_CODECS and dtype in (torch.float16, torch.bfloat16):
        own = lossless_codec(_DTYPE_NAMES[dtype])
        if name != own:
            allowed = tuple(c for c in CODEC_CHOICES if c not in LOSSLESS_CODECS or c == own)
            raise ValueError(f"kv_connector_extra_config: codec {name!r} would convert the model's "
                             f"{_DTYPE_NAMES[dtype]} KV to another 16-bit dtype (range or precision lost "
                             f"at the same bytes); for this model codec must be one of {allowed} "
                             f"('raw' and {own!r}: exact); got {name!r}")
    if name != RAW:
        return name
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"codec 'raw' needs KV dtype float16, bfloat16 or float32; got {dtype}")
    return lossless_codec(_DTYPE_NAMES[dtype])


def connector_config(extra: dict, block_tokens: int) -> tuple[KVTierConfig, str]:
    """The tier configuration and codec name of a connector from vLLM's ``kv_connector_extra_config``.

    ``extra`` may name a TOML file (``"config"``, KVTierConfig fields at top level or under
    ``[kvtier]``) and/or give fields inline (they override the file). Only
    :data:`CONNECTOR_FIELDS` apply; ``codec`` may also be ``"raw"`` (:func:`stored_codec`);
    ``block_tokens`` is vLLM's block size. Raises ValueError naming an unknown or unused field.

    Returns:
        ``(cfg, codec)``: ``cfg.codec`` is the codec except for ``"raw"``, which KVTierConfig
        does not know (``cfg.codec`` then keeps its default and is not used).
    """
    if not isinstance(extra, dict):
        raise ValueError(f"kv_connector_extra_config must be a dict; got {type(extra).__name__}")
    fields = dict(extra)
    path = fields.pop("config", None)
    data = {}
    if path is not None:
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"kv_connector_extra_config['config'] must be a TOML path; got {path!r}")
        data = KVTierConfig.from_toml(path).to_dict()
        data = {k: data[k] for k in CONNECTOR_FIELDS}
    unused = sorted(set(fields) - set(CONNECTOR_FIELDS))
    if unused:
        raise ValueError(f"kv_connector_extra_config: unknown or unused field(s) {unused}; "
                         f"allowed: ['config', {', '.join(map(repr, CONNECTOR_FIELDS))}]")
    data.update(fields)
    codec = data.get("codec", KVTierConfig.codec)
    if codec not in CODEC_CHOICES:
        raise ValueError(f"kv_connector_extra_config: codec must be one of {CODEC_CHOICES}; got {codec!r}")
    if codec == RAW:
        data.pop("codec")
        for name in ("key_codec", "value_codec"):
            if data.get(name) is not None:
                raise ValueError(f"kv_connector_extra_config: {name} must be unset with codec 'raw' (raw "
                                 f"stores both roles as vLLM holds them); got {data[name]!r}")
    data.update(block_tokens=block_tokens, device_tokens=block_tokens)
    return KVTierConfig.from_dict(data), codec


@dataclass(frozen=True)
class BlockShape:
    """What one (block, layer) holds: K and V of ``kv_heads`` heads, ``block_tokens`` x ``head_dim``."""

    num_layers: int
    kv_heads: int
    block_tokens: int
    head_dim: int
    dtype: torch.dtype


def block_codecs(cfg: KVTierConfig, codec: str, dtype: torch.dtype):
    """The ``(key, value)`` codec objects a connector encodes with: the same codecs as
    TieredCache's for this config (each role's codec, int8's zero points and value axis, int2's
    kept key channels, the key transform)."""
    return cfg.codec_pair(stored_codec(codec, dtype))


def content_fp(cfg: KVTierConfig, codec: str, shape: BlockShape, model_id: str) -> str:
    """The seed of every block key: the engine's identity (weights, KV config:
    :func:`identity.engine_identity`), the codecs' parameters as the codec objects state them,
    the KV dtype and page layout, and the deployment's namespace."""
    kc, vc = block_codecs(cfg, codec, shape.dtype)
    return model_fingerprint_key(
        model_id, stored_codec(codec, shape.dtype), shape.block_tokens,
        codec_params={"key": [kc.name, kc.params], "value": [vc.name, vc.params]},
        dtype=shape.dtype,
        extra={"layout": "vllm", "num_layers": shape.num_layers, "kv_heads": shape.kv_heads,
               "head_dim": shape.head_dim},
        namespace=cfg.namespace)


@dataclass
class _SaveJob:
    hashes: list[str]
    staged: list[torch.Tensor]  # per layer: [n, kv_heads, 2, block_tokens, head_dim]
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class LoadResult:
    """What :meth:`BlockStore.load` did: blocks written, per tier, and the first block that failed."""

    loaded: int = 0
    from_tier: dict = field(default_factory=lambda: {"l2": 0, "l3": 0, "l4": 0})
    first_failed: int | None = None  # index into the hashes; every block from it on is not loaded
    reason: str = ""


class BlockStore:
    """Full KV blocks of one model, encoded with one codec, in L2 + L3 + L4 (worker side).

    Args:
        cfg: the connector's tier configuration (:func:`connector_config`).
        codec: one of :data:`CODEC_CHOICES`.
        shape: the model's per-block KV shape.
        model_id: identity of the model (same in every engine that should share blocks).
    """

    def __init__(self, cfg: KVTierConfig, codec: str, shape: BlockShape, model_id: str) -> None:
        self.cfg, self.codec, self.shape = cfg, codec, shape
        self.fp = content_fp(cfg, codec, shape, model_id)
        kv_shape = (shape.kv_heads, shape.block_tokens, shape.head_dim)  # one role of one block
        self._kc, self._vc = block_codecs(cfg, codec, shape.dtype)
        ints = isinstance(self._kc, IntCodec) and isinstance(self._vc, IntCodec)
        self._decoder = BlockDecoder(self._kc, self._vc, kv_shape, shape.dtype) if ints else None
        self.l2 = HostTier(cfg.host_bytes, spill=self._dropped_from_l2, pin_memory=False)
        self.l3 = DiskTier(cfg.disk_path, capacity_bytes=cfg.disk_bytes, segment_bytes=cfg.disk_segment_bytes,
                           durability=cfg.durability, eviction=cfg.disk_eviction,
                           admission=cfg.disk_admission) if cfg.disk_path else None
        self.l4 = open_remote(cfg.remote_url, key_prefix=cfg.remote_key_prefix,
                              redis_timeout_s=_REMOTE_TIMEOUT_S) if cfg.remote_url else None
        self._lock = threading.Lock()  # guards _pending and _n
        self._pending: dict[str, _SaveJob] = {}  # block hash -> the job that is writing it
        self._n = dict(saved_blocks=0, stored_bytes=0, l2_dropped=0, loaded_blocks=0, load_failures=0,
                       l2_hits=0, l3_hits=0, l4_hits=0, lookups=0, lookup_hits=0)
        self._jobs: queue.Queue[_SaveJob | None] = queue.Queue(maxsize=_SAVE_QUEUE_JOBS)
        self._writer = threading.Thread(target=self._write_loop, name="kvtier-vllm-writer", daemon=True)
        self._writer.start()

    # -- keys --------------------------------------------------------------------------------
    def key(self, layer: int, block_hash: str) -> str:
        return block_key(self.fp, layer, block_hash)

    # -- save --------------------------------------------------------------------------------
    def save(self, hashes: list[str], staged: list[torch.Tensor]) -> None:
        """Queue blocks for encoding and writing; returns at once unless the queue is full.

        Args:
            hashes: content hash of each block.
            staged: one tensor per layer, ``[len(hashes), kv_heads, 2, block_tokens, head_dim]``
                (K rows then V rows per head, vLLM's CPU page layout), owned by the store from now on.
        """
        assert len(staged) == self.shape.num_layers, f"{len(staged)} layers staged of {self.shape.num_layers}"
        job = _SaveJob(list(hashes), staged)
        with self._lock:
            for h in job.hashes:
                self._pending[h] = job
        self._jobs.put(job)

    def _dropped_from_l2(self, records) -> None:
        # Every record was written through to L3/L4 when it was stored: the ring just forgets it.
        with self._lock:
            self._n["l2_dropped"] += len(records)

    def _encode(self, job: _SaveJob) -> list[tuple[str, bytes]]:
        items = []
        for layer, blocks in enumerate(job.staged):
            kv = blocks.transpose(1, 2).contiguous()  # [n, 2, kv_heads, block_tokens, head_dim]
            for h, block in zip(job.hashes, kv):
                items.append((self.key(layer, h), pack_block(self._kc.encode(block[0]), self._vc.encode(block[1]))))
        return items

    def _write_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                items = self._encode(job)
                for key, rec in items:
                    if self.l2.record_bytes(key, len(rec)) <= self.l2.capacity_bytes:  # else only L3/L4
                        self.l2.put(key, rec)
                if self.l3 is not None:  # copies of vLLM's blocks: admission may turn them away
                    self.l3.offer_many(items)
                if self.l4 is not None:
                    self.l4.put_many(items)
                with self._lock:
                    self._n["saved_blocks"] += len(job.hashes)
                    self._n["stored_bytes"] += sum(len(rec) for _, rec in items)
            except Exception:  # a failed save is a later cache miss, never a failed request
                log.exception("kvtier: saving %d block(s) failed; they will be recomputed when needed",
                              len(job.hashes))
            finally:
                with self._lock:
                    for h in job.hashes:
                        if self._pending.get(h) is job:
                            del self._pending[h]
                job.staged = []
                job.done.set()

    def flush(self) -> None:
        """Wait until every queued save is written."""
        with self._lock:
            jobs = list({id(j): j for j in self._pending.values()}.values())
        for job in jobs:
            job.done.wait()

    # -- lookup ------------------------------------------------------------------------------
    def _present(self, tier, hashes: list[str]) -> list[bool]:
        """Whether each block is whole in ``tier``. Its first and last layer are checked: a
        block's layers are written in order in one batch, and L2 drops records oldest first."""
        last = self.shape.num_layers - 1
        keys = [k for h in hashes for k in (self.key(0, h), self.key(last, h))]
        if tier is self.l4:  # one round trip for the lot (Redis and Mooncake both batch it)
            got = tier.contains_many(keys)
        else:
            got = [tier.contains(k) for k in keys]
        return [got[2 * i] and got[2 * i + 1] for i in range(len(hashes))]

    def lookup(self, hashes: list[str]) -> int:
        """Number of leading blocks of ``hashes`` that some tier holds (or a queued save will)."""
        with self._lock:
            pending = [h in self._pending for h in hashes]
        have = [p or l2 for p, l2 in zip(pending, self._present(self.l2, hashes))]
        for tier in (self.l3, self.l4):
            n = have.index(False) if False in have else len(have)
            if tier is None or n == len(have):
                continue
            rest = self._present(tier, hashes[n:])
            have[n:] = [a or b for a, b in zip(have[n:], rest)]
        n = have.index(False) if False in have else len(have)
        with self._lock:
            self._n["lookups"] += 1
            self._n["lookup_hits"] += n
        return n

    # -- load --------------------------------------------------------------------------------
    def _fetch(self, keys: list[str], counts: dict) -> list:
        """Records of ``keys``: L2, then L3, then L4 for what is still missing (one round trip)."""
        recs = [self.l2.get(k) for k in keys]
        counts["l2"] += sum(r is not None for r in recs)
        if self.l3 is not None:
            for i, k in enumerate(keys):
                if recs[i] is None and (r := self.l3.get(k)) is not None:
                    recs[i] = r
                    counts["l3"] += 1
        missing = [i for i, r in enumerate(recs) if r is None]
        if self.l4 is not None and missing:
            for i, r in zip(missing, self.l4.get_many([keys[i] for i in missing])):
                if r is not None:
                    recs[i] = r
                    counts["l4"] += 1
        return recs

    def _decode(self, rec) -> torch.Tensor:
        """``[2, kv_heads, block_tokens, head_dim]`` of one record; raises ValueError when corrupt
        or of another layout."""
        out = self._decoder.decode(rec) if self._decoder is not None else None
        if out is None:
            k, v = unpack_block(rec)
            out = torch.stack((self._kc.decode(k), self._vc.decode(v)))
        want = (2, self.shape.kv_heads, self.shape.block_tokens, self.shape.head_dim)
        if tuple(out.shape) != want or out.dtype != self.shape.dtype:
            raise ValueError(f"record holds {tuple(out.shape)} {out.dtype}, expected {want} {self.shape.dtype}")
        return out

    def flush_hashes(self, hashes: list[str]) -> None:
        """Wait for the queued saves of ``hashes`` (a load right after the save that queued them)."""
        with self._lock:
            jobs = {id(j): j for h in hashes if (j := self._pending.get(h)) is not None}
        for job in jobs.values():
            job.done.wait()

    def fetch_layer(self, layer: int, hashes: list[str], counts: dict) -> list:
        """One layer's records of ``hashes`` (None where no tier has a sound one); ``counts``
        (``{"l2": n, "l3": n, "l4": n}``) gains the records each tier supplied."""
        return self._fetch([self.key(layer, h) for h in hashes], counts)

    def forget(self, hashes: list[str]) -> None:
        """Delete every layer of ``hashes`` from every tier (a block that failed to load), so
        the next request that computes it stores it afresh."""
        keys = [self.key(layer, h) for h in hashes for layer in range(self.shape.num_layers)]
        for k in keys:
            self.l2.delete(k)
        for t in (self.l3, self.l4):
            if t is not None:
                t.delete_many(keys)

    def write_layer(self, recs: list, pages: torch.Tensor, block_ids: list[int]) -> int | None:
        """Decode one layer's records into ``pages[block_ids[i]]``; ``pages`` is the layer's
        ``[num_blocks, kv_heads, 2, block_tokens, head_dim]`` view. Returns the index of the first
        record that failed to decode (it and the rest are not written), or None."""
        for i, (rec, b) in enumerate(zip(recs, block_ids)):
            try:
                kv = self._decode(rec)  # [2, kv_heads, block_tokens, head_dim]
            except ValueError as e:
                log.debug("kvtier: record of block %d does not decode: %s", i, e)
                return i
            pages[b].copy_(kv.transpose(0, 1))  # [kv_heads, 2, block_tokens, head_dim]
        return None

    def count_load(self, res: LoadResult, failed: bool) -> None:
        with self._lock:
            self._n["loaded_blocks"] += res.loaded
            self._n["load_failures"] += failed
            for t in ("l2", "l3", "l4"):
                self._n[f"{t}_hits"] += res.from_tier[t]

    # -- reporting and lifetime ----------------------------------------------------------------
    def stats(self) -> dict:
        """Counters (blocks, bytes), per-tier usage and the stored bytes per token, JSON-able."""
        with self._lock:
            n = dict(self._n)
        tokens = n["saved_blocks"] * self.shape.block_tokens
        n["bytes_per_token"] = n["stored_bytes"] / tokens if tokens else None
        n["codec"] = self.codec
        n["tiers"] = {name: (None if t is None else {"used_bytes": t.used_bytes, "records": len(t)})
                      for name, t in (("l2", self.l2), ("l3", self.l3), ("l4", self.l4))
                      if name != "l4" or t is None}
        if self.l4 is not None:
            n["tiers"]["l4"] = {"connected": self.l4.connected}
        return n

    def close(self) -> None:
        """Write what is queued, then close every tier (L3 is synced)."""
        self._jobs.put(None)
        self._writer.join()
        for t in (self.l3, self.l4, self.l2):
            if t is not None:
                t.close()
