"""TieredCache: a transformers 5.x ``Cache`` whose layers live in a :class:`kvtier.store.KVStore`.

One TieredCache holds one batch (batch row ``b`` is one store sequence, :mod:`.rows`); each
model layer is a :class:`TieredLayer` (a ``CacheLayerMixin``) that appends to the store and reads
it back. Caches of one model and configuration share one process-wide store (:mod:`.registry`):
make one per conversation or request, and close it (``close()``, ``with``, or just drop it) to
give its sequences back.

```
 dense   update(k, v):  append ──► gather (blocks below L1 swapped in) ──► attention: SDPA
 sparse  update(k, v):  append ──► Handover(SPARSE)   (decode step, one query token)
         attention("kvtier"):      select with the query ──► gather_view ──► attend ──► observe
```
In sparse mode, multi-token steps (prefill) attend densely (``Handover(DENSE)``) and seed the
H2O/SnapKV statistics from the last queries; only single-token decode steps are budgeted. A
layer finishes when its attention has what it needs (dense mode: at ``update``, the gathered K/V
being a copy; sparse mode: after kvtier's attention), and the store's step boundary (eviction,
async swap-out, prefetch) runs when the last layer finishes (:mod:`.handover`).

A forward that fails anywhere leaves no trace (:mod:`.steps`); hand-overs travel in that forward's
own attention kwargs, so nothing of it can reach a later forward of this or any other cache.
Prefix reuse (:mod:`.prefix`): full blocks get content-addressed keys from the token ids of what
is appended, and :meth:`TieredCache.load_prefix` links the longest prefix already stored before a
prefill, so ``generate`` computes only the rest.

Batch rows must all have the same length (transformers pads; padding masks are respected by both
paths). ``crop`` cuts every row anywhere (assisted, speculative and prompt-lookup decoding);
``reorder_cache``, ``batch_select_indices`` and ``batch_repeat_interleave`` rename, drop or fork
sequences (a fork shares the sealed blocks by reference count); ``copy.deepcopy(cache)`` and
:meth:`TieredCache.fork` give a second cache continuing from the same tokens the same way.
"""
from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, get_layer_types_and_kwargs

from kvtier.config import KVTierConfig
from kvtier.identity import model_identity
from kvtier.store import KVStore
from kvtier.store.report import store_summary

from . import registry
from .handover import HANDOVER_KWARG, Handover, Step, StepKind
from .hooks import ForwardObserver, detach, register_hooks, switch_attention
from .layer import TieredLayer
from .prefix import TokenKeys
from .steps import ForwardSteps
from .rows import BatchRows
from .sparse import budgeted_attention

__all__ = ["TieredCache", "TieredLayer", "attach", "detach"]

_OBSERVING_POLICIES = ("h2o", "snapkv")


def _model_shape(model_config) -> tuple[int, int, int]:
    cfg = model_config.get_text_config(decoder=True)
    layer_types, _ = get_layer_types_and_kwargs(cfg)
    other = sorted(set(layer_types) - {"full_attention"})
    if other:
        raise ValueError(f"model layers must all be 'full_attention' for TieredCache; found {other}")
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def _release(rows: BatchRows, lease: registry.StoreLease) -> None:
    """A cache's end (close, ``with`` exit, garbage collection): sequences, then the lease."""
    try:
        rows.release()
    finally:
        lease.release()


class TieredCache(Cache, ForwardObserver):
    """A transformers ``Cache`` backed by kvtier's tiered store.

    Args:
        config: the kvtier configuration.
        model: the model this cache serves. Gives the shape, dtype, device and fingerprint; the
            model is switched to kvtier's attention (as :func:`attach` does): budgeted decode in
            sparse mode, split prefills over a cached prefix in both modes, SDPA otherwise.
        model_config, num_layers, kv_heads, head_dim, dtype, device, fingerprint: used instead
            of (or to override) what ``model`` gives, for a cache built without a model.
        store: None (default): the process's store for this model and configuration, opened on
            first use and closed when its last cache closes (:mod:`kvtier.hf.registry`).
            A :class:`KVStore` of the same model and config: use that one (a store you built
            stays yours to close). A cache without a fingerprint (built without a model, or of
            a model whose weights cannot be read) never gives token ids, so it may share the
            store of any model of its shape: its blocks stay private to it.
        salt: the tenant this conversation belongs to (as vLLM's ``cache_salt``): its blocks
            are shared only with caches of the same salt (and model, codec and namespace).
            ``""`` (default): shared with every other unsalted cache of this deployment.
    """

    def __init__(
        self,
        config: KVTierConfig,
        model=None,
        *,
        model_config=None,
        num_layers: int | None = None,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        fingerprint: str | None = None,
        store: KVStore | None = None,
        salt: str = "",
    ):
        if not isinstance(config, KVTierConfig):
            raise ValueError(f"config must be a kvtier.KVTierConfig, got {type(config).__name__}")
        if not isinstance(salt, str) or len(salt.encode()) > 4096:
            raise ValueError(f"salt must be a str of at most 4096 UTF-8 bytes; got {salt!r:.80}")
        if model is not None:
            model_config = model_config or model.config
            param = next(model.parameters())
            dtype = dtype or param.dtype
            device = device or param.device
            fingerprint = fingerprint if fingerprint is not None else model_identity(model)
        if model_config is not None:
            n, kvh, hd = _model_shape(model_config)
            num_layers, kv_heads, head_dim = num_layers or n, kv_heads or kvh, head_dim or hd
        if num_layers is None or kv_heads is None or head_dim is None:
            raise ValueError("TieredCache needs the model shape: pass model=, model_config= or "
                             "num_layers=, kv_heads= and head_dim=")
        dtype = dtype or torch.float32
        device = torch.device(device or "cpu")
        self.config = config
        self.fingerprint = fingerprint or ""
        self.salt = salt
        # a model with inputs beside text (images, audio: a composite config) makes K/V the
        # token ids do not name (an image's placeholder ids are the same for every image), and
        # a forward may carry them with no sign the ids can see: its blocks are never shared
        shareable = bool(self.fingerprint) and (
            model_config is None or model_config.get_text_config(decoder=True) is model_config)
        # the model object this cache was built for: another model's forward is refused
        self._model = weakref.ref(model) if model is not None else None
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype = dtype  # what attention receives (the store may keep another dtype: config.dtype)
        self.device = device
        if store is None:
            lease = registry.lease(config, num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim,
                                   dtype=dtype, device=device, fingerprint=self.fingerprint)
        else:
            if not isinstance(store, KVStore):
                raise ValueError(f"store must be a kvtier KVStore or None; got {type(store).__name__}")
            if (store.num_layers, store.kv_heads, store.head_dim) != (num_layers, kv_heads, head_dim) \
                    or (self.fingerprint and store.fingerprint != self.fingerprint) or store.cfg != config:
                raise ValueError("store must belong to the same model (shape, fingerprint) and config")
            lease = registry.lease_existing(store)
        self.store = lease.store
        self._rows = BatchRows(self.store)
        self._keys = TokenKeys(self.store, self._rows, salt, shareable)
        self._finalizer = weakref.finalize(self, _release, self._rows, lease)
        super().__init__(layers=[TieredLayer(self, i) for i in range(num_layers)])
        self._sparse = config.attention == "sparse"
        # dense attention observes only for precision="importance" (its codec choice and recall
        # upgrades rank blocks by these statistics), and only where the model attends through
        # kvtier's attention (built with the model): one more attention pass per layer and step.
        # Without it every evicted block is stored in the base codec.
        self._observe = config.policy in _OBSERVING_POLICIES and (
            self._sparse or (config.precision == "importance" and model is not None))
        self._budget = self.store.budget_tokens
        self._counters = dict(forwards=0, decode_steps=0, sparse_steps=0, dense_steps=0,
                              attended_tokens=0, context_tokens=0, selected_blocks=0,
                              rolled_back_steps=0, cropped_tokens=0)
        self._steps = ForwardSteps(self.store, self._rows, self._keys, self.layers, self._counters)
        if model is not None:
            register_hooks(model)
            switch_attention(model)

    @property
    def seqs(self) -> list[int]:
        """Store sequence of each batch row (read-only use; the rows change through the batch methods)."""
        return self._rows.seqs

    @seqs.setter
    def seqs(self, value: list[int]) -> None:
        # kept for code that fills a cache itself (persist.load_cache): sequences it registered
        self._rows.seqs = list(value)

    @property
    def is_initialized(self) -> bool:
        return bool(self.layers) and all(layer.is_initialized for layer in self.layers)

    # -- the update path ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("TieredCache is closed; make a new one (kvtier.attach(model, config))")

    def check_model(self, model) -> None:
        """Refuse a forward of another model than the one this cache was built for (the pre-hook
        calls this): its K/V would be stored under this model's identity.

        Raises:
            ValueError: naming both identities (or shapes, for a cache built without a model).
        """
        self._check_open()
        mine = self._model() if self._model is not None else None
        if model is mine:
            return
        shape = _model_shape(model.config)
        if shape != (self.num_layers, self.kv_heads, self.head_dim):
            raise ValueError(f"this TieredCache belongs to another model: it was built for "
                             f"{self.num_layers} layers x {self.kv_heads} kv heads x head_dim {self.head_dim}"
                             f"{f' (identity {self.fingerprint})' if self.fingerprint else ''}, and "
                             f"{type(model).__name__} has {shape[0]} x {shape[1]} x {shape[2]}; make a cache "
                             f"for this model: kvtier.attach(model, config)")
        if not self.fingerprint:
            return  # built without a model: its blocks are never shared, any model of its shape may use it
        theirs = model_identity(model)
        if theirs != self.fingerprint:
            self.store.counters.add(identity_refusals=1)
            raise ValueError(f"this TieredCache belongs to another model: it was built for identity "
                             f"{self.fingerprint}, and the forward is of {type(model).__name__} with identity "
                             f"{theirs or '(unknown: weights not readable)'} (other weights, adapter or "
                             f"config); make a cache for this model: kvtier.attach(model, config)")
        self._model = weakref.ref(model)  # another object with the same weights (a reload)

    def get_seq_length(self, *args, **kwargs) -> int:
        self._check_open()
        return super().get_seq_length(*args, **kwargs)

    def _update(self, layer: TieredLayer, k: torch.Tensor, v: torch.Tensor, attn_kwargs: dict | None):
        self._check_open()
        b, h, t, d = k.shape
        l = layer.layer_idx
        if h != self.kv_heads or d != self.head_dim:
            raise ValueError(f"key states must be [batch, {self.kv_heads}, t, {self.head_dim}]; got {tuple(k.shape)}")
        if l == 0:
            self._steps.begin(b, t)
        step = self._step
        if step is None:
            raise ValueError(f"first update of a forward must be layer 0; got layer {l}")
        stale = step.unclaimed()
        if stale is not None or b != len(self._rows) or layer.length != step.start or t != step.tokens:
            self._steps.abort()
            if stale is not None:
                raise RuntimeError(
                    f"TieredCache: layer {stale.layer} appended in sparse mode but kvtier's attention "
                    f"never ran for it (the step was rolled back); use kvtier.attach(model, config) "
                    f"(or TieredCache(config, model)) so the model attends through "
                    f"attn_implementation='kvtier'")
            raise ValueError(f"layer {l} got [batch {b}, t {t}] after {layer.length} tokens; this "
                             f"forward started at {step.start} tokens with [batch {len(self._rows)}, "
                             f"t {step.tokens}] (the step was rolled back)")
        past = step.start
        try:
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
            if l == 0:
                self._keys.note(t, past)
            for row, seq in enumerate(self._rows.seqs):
                self.store.append(seq, l, k[row], v[row])  # [kv_heads, t, head_dim]
            layer.length = past + t
            out = self._hand_over(l, k, v, past, t, attn_kwargs)
        except BaseException:
            self._steps.abort()
            raise
        if l == 0:
            self._counters["forwards"] += 1
            if t == 1 and past > 0:
                self._counters["decode_steps"] += 1
        return out

    def _hand_over(self, l: int, k, v, past: int, t: int, attn_kwargs: dict | None):
        """What update returns, and what kvtier's attention is handed for this layer's call."""
        if self._sparse and t == 1 and past > 0 and attn_kwargs is not None:
            self._offer(StepKind.SPARSE, l, k, attn_kwargs)
            return k, v  # the attention reads the rest from the store
        out = (k, v) if past == 0 else self._gather(l)
        if (self._sparse or self._observe) and attn_kwargs is not None:
            self._offer(StepKind.DENSE, l, out[0], attn_kwargs)  # finished by after_dense_attention
            return out
        if t > 1 and past > 0 and attn_kwargs is not None and self.config.attention_math != "sdpa":
            self._offer(StepKind.SPLIT, l, out[0], attn_kwargs)  # a hint: SDPA is as right
        self._steps.layer_done(l, self.layers[l].length)
        return out

    def _offer(self, kind: StepKind, l: int, key: torch.Tensor, attn_kwargs: dict) -> None:
        h = Handover(self, l, kind, weakref.ref(key))
        attn_kwargs[HANDOVER_KWARG] = h
        if kind is not StepKind.SPLIT:  # the layer cannot finish without its attention
            self._steps.current.handover = h

    def forward_ended(self, failed: bool) -> None:
        """The model's forward returned (``failed``: it raised). Called by the forward hook."""
        self._steps.ended(failed)

    @property
    def _step(self) -> Step | None:
        """The forward in flight (:class:`.steps.ForwardSteps`), None between forwards."""
        return self._steps.current

    # -- token ids and prefix reuse ------------------------------------------------------------------

    def set_input_ids(self, input_ids: torch.Tensor | None) -> None:
        """Token ids of the next forward ([batch, t], what ``input_ids`` holds); the pre-hook of
        :func:`attach` calls this. They are noted in the store when that forward appends."""
        self._check_open()
        self._keys.expect(input_ids)

    @property
    def _ids_ok(self) -> bool:
        """Whether this cache's blocks still get content-addressed keys (:class:`.prefix.TokenKeys`)."""
        return self._keys.ok

    def note_tokens(self, input_ids: torch.Tensor) -> None:
        """Explicitly give the ids of the next forward (when the model is not :func:`attach`-ed)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("input_ids must be a [batch, t] tensor of token ids")
        self.set_input_ids(input_ids)

    def load_prefix(self, input_ids: torch.Tensor) -> int:
        """Link the longest stored prefix of ``input_ids`` into this (empty) cache, before prefill.

        Every row gets the same number of tokens (the shortest match), whole blocks, and always
        less than the prompt so the forward computes at least the last token's logits. Then
        ``generate(input_ids, cache=cache)`` feeds only ``input_ids[:, n:]`` (a direct
        ``model(...)`` call must pass that slice itself).

        Args:
            input_ids: [batch, T] token ids of the whole prompt.
        Returns:
            n, the tokens found (0 when nothing is stored, or the cache shares nothing: no
            fingerprint, or a model with non-text inputs).
        """
        self._check_open()
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError("input_ids must be a [batch, T] tensor of token ids with T >= 1")
        if self.get_seq_length() or any(self.store.seq_len(s, 0) for s in self._rows):
            raise ValueError("load_prefix needs an empty cache (call it before the prefill, or reset())")
        n = self._keys.link(input_ids)
        if n == 0:
            return 0
        self._filled(n)
        self.store.end_step()
        self._counters["prefix_tokens"] = self._counters.get("prefix_tokens", 0) + n
        return n

    def _filled(self, n: int) -> None:
        """Every layer now holds ``n`` tokens appended outside a forward (prefix, wrap, load)."""
        for layer in self.layers:
            layer.device = self.device
            layer.is_initialized = True
            layer.length = n

    def _gather(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token of layer ``l`` for the whole batch: K, V [batch, kv_heads, T, head_dim]."""
        self._check_open()
        store = self.store
        seqs = self._rows.seqs
        if len(seqs) == 1:
            k, v = store.gather(seqs[0], l)
            k, v = k.unsqueeze(0), v.unsqueeze(0)
        else:
            ks, vs = zip(*(store.gather(s, l) for s in seqs))
            k, v = torch.stack(ks), torch.stack(vs)
        if k.dtype != self.dtype:
            k, v = k.to(self.dtype), v.to(self.dtype)
        return k, v

    # -- called by kvtier's attention function --------------------------------------------------

    def after_dense_attention(self, l: int, query: torch.Tensor) -> None:
        """After a multi-token step in sparse mode, or any step of an observing dense one: seed
        H2O/SnapKV from the last queries."""
        if self._observe:
            w = min(query.shape[2], self.config.block_tokens)
            # dense mode: the keys this layer attended (the hand-over's), not a second gather
            h = self._step.handover if not self._sparse else None
            keys = h.key() if h is not None and h.layer == l else None
            for row, seq in enumerate(self._rows.seqs):
                self.store.observe_queries(seq, l, query[row, :, -w:],  # [q_heads, w, head_dim]
                                           None if keys is None else keys[row].to(self.store.dtype))
        if l == 0:
            self._counters["dense_steps"] += 1
        self._steps.layer_done(l, self.layers[l].length)

    def sparse_attention(self, l: int, query: torch.Tensor, attention_mask: torch.Tensor | None,
                         scaling: float, module: torch.nn.Module | None = None) -> torch.Tensor:
        """Budgeted attention of a one-token step (:func:`.sparse.budgeted_attention`).

        Args:
            query: [batch, q_heads, 1, head_dim]; attention_mask: bool [batch|1, 1, 1, T] or None.
            module: the model's attention module (``attention_math="sdpa"`` calls SDPA as it would).
        Returns:
            [batch, 1, q_heads, head_dim].
        """
        sdpa = module if self.config.attention_math == "sdpa" else None
        r = budgeted_attention(self.store, self._rows.seqs, l, query, attention_mask, scaling,
                               self._budget, self._observe, sdpa_module=sdpa)
        self._steps.observed += r.observed
        if l == 0:
            self._counters["sparse_steps"] += 1
        self._counters["selected_blocks"] += r.selected_blocks
        self._steps.layer_done(l, r.attended)
        return r.out

    # -- batch manipulation (all or nothing: .rows) ---------------------------------------------------

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes old row ``beam_idx[i]``."""
        self._check_open()
        self._rows.rebatch([int(i) for i in beam_idx.tolist()], "reorder_cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` names (ints, negative from the end, or a bool mask), as
        ``DynamicCache`` indexes its tensors; a repeated row is a fork."""
        self._check_open()
        rows = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
        if rows and isinstance(rows[0], bool):
            rows = [i for i, keep in enumerate(rows) if keep]
        n = len(self._rows)
        self._rows.rebatch([int(i) + n if -n <= int(i) < 0 else int(i) for i in rows], "batch_select_indices")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._check_open()
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be an int >= 1; got {repeats!r}")
        self._rows.rebatch([r for r in range(len(self._rows)) for _ in range(repeats)],
                           "batch_repeat_interleave")

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-n`` tokens of every row and layer (``n <= 0``; beyond the length, all
        of them), as transformers 5.x's ``DynamicCache.crop``, which refuses ``n > 0`` (the old
        ``crop(max_length)``) with a ValueError: so does this, changing nothing.

        The cut may fall anywhere, across blocks already evicted and quantized: see
        :meth:`KVStore.truncate_sequence` (with a lossy codec, the tokens kept of a block that
        had left L1 are its codec reconstruction).
        """
        self._check_open()
        n = tokens_to_remove
        if isinstance(n, bool) or not isinstance(n, int):
            raise ValueError(f"tokens_to_remove must be an int <= 0; got {n!r}")
        if n > 0:
            raise ValueError(f"tokens_to_remove must be <= 0 (the number of tokens to remove, negated; "
                             f"transformers refuses the old positive crop(max_length) too); got {n}")
        cur = self.get_seq_length()
        target = max(0, cur + n)
        self._steps.current = None  # between forwards: nothing is in flight
        if target >= cur:
            return
        self._rows.truncate(target)
        for layer in self.layers:
            layer.length = min(layer.length, target)
        self._counters["cropped_tokens"] += cur - target

    def reset(self) -> None:
        """Give every sequence back to the store (which stays open for the next batch), leaving
        nothing of this cache in it. Content-addressed blocks stay in L3 for :meth:`load_prefix`
        of a later conversation, until L3 needs the room."""
        self._check_open()
        self._rows.release()
        self._keys.restart()
        self._steps.current = None
        self._steps.observed.clear()
        for layer in self.layers:
            layer.reset()

    def offload(self, layer_idx: int, only_non_sliding: bool = True):
        raise NotImplementedError("TieredCache.offload: kvtier moves blocks between tiers itself")

    # -- forks ---------------------------------------------------------------------------------------

    def fork(self) -> "TieredCache":
        """A second cache continuing from this one's tokens, on the same store.

        Every row is forked (:meth:`KVStore.fork_sequence`): sealed blocks are shared by
        reference count, not copied, below L1; the open block is copied (copy-on-write). Each
        cache then grows on its own; closing one leaves the other intact.
        """
        self._check_open()
        if self._step is not None and not self._step.finished:
            raise RuntimeError("TieredCache.fork: a forward is in flight")
        other = TieredCache(self.config, num_layers=self.num_layers, kv_heads=self.kv_heads,
                            head_dim=self.head_dim, dtype=self.dtype, device=self.device,
                            fingerprint=self.fingerprint, store=self.store, salt=self.salt)
        other._model = self._model
        other._keys.shareable = self._keys.shareable
        try:
            other._rows.seqs = self._rows.fork_all()
        except BaseException:
            other.close()  # its lease on the store, now rather than whenever it is collected
            raise
        for mine, theirs in zip(self.layers, other.layers):
            theirs.length = mine.length
            theirs.is_initialized = mine.is_initialized
            if mine.is_initialized:
                theirs.device = mine.device
        other._keys.ok = self._keys.ok
        return other

    def __deepcopy__(self, memo) -> "TieredCache":
        """``copy.deepcopy(cache)`` (transformers' prompt-reuse recipe) is :meth:`fork`."""
        other = self.fork()
        memo[id(self)] = other
        return other

    # -- reporting and lifecycle -------------------------------------------------------------------

    def stats(self) -> dict:
        """The store's statistics plus this cache's own (JSON-serialisable): ``"conversation"``
        (this cache's rows) and ``"store"`` (every cache on the shared store) in the README's
        units, the store's raw figures at the top level and this cache's counters under
        ``"integration"`` (docs/transformers.md, "Reading stats()")."""
        self._check_open()
        s = self.store.stats()
        c = dict(self._counters)
        ctx = c["context_tokens"] * self.num_layers
        c["attended_fraction"] = (c["attended_tokens"] / ctx) if ctx else None
        c["batch"] = len(self._rows)
        c["seq_length"] = self.get_seq_length()
        c["copied_sequences"] = self._rows.forked
        s["integration"] = c
        conv = self.store.sequences_stats(list(self._rows.seqs))
        conv.update(batch=c["batch"], seq_length=c["seq_length"],
                    prefix_tokens_reused=c.get("prefix_tokens", 0), attended_share=c["attended_fraction"])
        s["conversation"] = conv
        s["store"] = store_summary(s, self.num_layers)
        return s

    def close(self) -> None:
        """Give this cache's sequences back to the store, and close the store if it was the
        last cache on it. The cache must not be used afterwards; closing twice is harmless."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if not self._finalizer.alive:
            return f"TieredCache(layers={self.num_layers}, closed)"
        return (f"TieredCache(layers={self.num_layers}, batch={len(self._rows)}, "
                f"tokens={self.get_seq_length()}, attention={self.config.attention!r}, codec={self.config.codec!r})")

    # -- taking over and persisting ------------------------------------------------------------------

    @classmethod
    def wrap(cls, existing_cache: Cache, config: KVTierConfig, model=None, *, release: bool = True) -> "TieredCache":
        """Take over a filled transformers cache (e.g. a ``DynamicCache`` after a prefill).

        Its K and V move into the tiers without recomputation; with ``release`` (default) the
        source layers are emptied afterwards, so their memory is freed.

        Args:
            existing_cache: a ``DynamicCache`` (full-attention layers, all of the same length).
            config: kvtier configuration of the new cache.
            model: the model it belongs to (gives the fingerprint; switches attention in sparse mode).
        """
        from .takeover import take_over

        return take_over(cls, existing_cache, config, model, release=release)

    def save(self, path) -> None:
        """Write this conversation to an HDF5 file (see :mod:`kvtier.hf.persist`)."""
        self._check_open()
        from .persist import save_cache

        save_cache(self, path)

    @classmethod
    def load(cls, path, config: KVTierConfig, model=None, *, fingerprint: str | None = None) -> "TieredCache":
        """Read a cache written by :meth:`save`, refusing it if it belongs to another model.

        Args:
            path: the HDF5 file.
            config: kvtier configuration of the new cache (tiers may differ from the saved one's).
            model: the model that will continue the conversation (its fingerprint is checked).
            fingerprint: the expected fingerprint when no model is given.
        """
        from .persist import load_cache

        return load_cache(cls, path, config, model=model, fingerprint=fingerprint)


def attach(model, config: KVTierConfig, *, store: KVStore | None = None, salt: str = "") -> TieredCache:
    """A :class:`TieredCache` bound to ``model``, which then attends through kvtier's attention.

    Pass the result as ``cache=`` (``past_key_values=`` is still accepted) to ``model.generate``
    or ``model(...)``. Every cache of this model and configuration shares the process's store:
    make one per conversation, and close it (or let it go) when the conversation ends.
    Hooks on ``model`` (registered once by any TieredCache built with a model) hand each
    forward's ``input_ids`` to the TieredCache it is given, so the store learns the token ids
    (content-addressed keys, prefix reuse), and roll a failed forward's step back;
    :func:`detach` removes them. ``salt`` names the tenant of this conversation: its blocks are
    shared only with conversations of the same salt (:class:`TieredCache`).
    """
    return TieredCache(config, model, store=store, salt=salt)
