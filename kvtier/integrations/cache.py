"""TieredCache: a transformers 5.x ``Cache`` whose layers live in a :class:`kvtier.store.KVStore`.

One TieredCache holds one batch: batch row ``b`` is store sequence ``seqs[b]``; each model layer
is a :class:`TieredLayer` (a ``CacheLayerMixin``) that appends to the store and reads it back.

```
 dense   update(k, v):  append ──► gather (blocks below L1 swapped in) ──► attention("kvtier"): SDPA
 sparse  update(k, v):  append ──► note "pending"   (decode step, one query token)
         attention("kvtier"):      select with the query ──► gather_view ──► attend ──► observe
```
In sparse mode, multi-token steps (prefill) attend densely and seed the H2O/SnapKV statistics
from the last queries; only single-token decode steps are budgeted. The store's step boundary
(eviction, async swap-out, prefetch) is run after the last layer of every forward.

In both modes a multi-token step over tokens already cached (the prefill after ``load_prefix``, a
chunked prefill) attends in two unmasked passes merged by log-sum-exp instead of one SDPA over an
explicit mask (:func:`kvtier.integrations.attention.split_prefix_attention`): the update notes
the layer and the K it returned, and kvtier's attention takes that path only for that exact call
(and only when the mask is exactly causal: no padding).

Prefix reuse (issue 7): the store gets the token ids of what is appended (captured from
``input_ids`` by a forward pre-hook that :func:`attach` registers, or given with
:meth:`TieredCache.note_tokens`), so full blocks get content-addressed keys. Before a prefill,
:meth:`TieredCache.load_prefix` links the longest prefix already stored (by another sequence of
the same store, an earlier process's L3 directory, or the L4 server) and ``generate`` computes
only the rest:

```
 n = cache.load_prefix(ids)                    # tokens found, whole blocks, < len(ids)
 model.generate(ids, past_key_values=cache)    # transformers feeds ids[:, n:] only
```

Batch rows must all have the same length (transformers pads; padding masks are respected by both
paths). ``crop`` (except ``crop(0)``) is not supported and raises ``NotImplementedError``;
``reorder_cache``, ``batch_select_indices`` and ``batch_repeat_interleave`` work: a permutation
only renames sequences, a repeated row is copied (gathered and appended again).
"""
from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, get_layer_types_and_kwargs

from kvtier.config import KVTierConfig
from kvtier.store import KVStore

from . import attention as _attn
from .model import model_fingerprint

__all__ = ["TieredCache", "TieredLayer", "attach", "detach"]

_OBSERVING_POLICIES = ("h2o", "snapkv")


class TieredLayer(CacheLayerMixin):
    """One model layer of a :class:`TieredCache`; the tokens live in the store, not here."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, cache: "TieredCache", layer_idx: int):
        super().__init__()
        # A weak reference: the cache owns its layers, not the other way round.
        self._cache_ref = weakref.ref(cache)
        self.layer_idx = layer_idx
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``[batch, kv_heads, t, head_dim]`` states; return what attention should see."""
        return self._cache_ref()._update(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0
        self.is_initialized = False

    def offload(self):
        raise NotImplementedError("TieredLayer.offload: kvtier tiers the cache itself; do not combine it "
                                  "with transformers' cache offloading")

    def prefetch(self):
        raise NotImplementedError("TieredLayer.prefetch: kvtier prefetches inside its store")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("TieredLayer.crop: call TieredCache.crop")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("TieredLayer.reorder_cache: call TieredCache.reorder_cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("TieredLayer.batch_repeat_interleave: call TieredCache.batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("TieredLayer.batch_select_indices: call TieredCache.batch_select_indices")


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


class TieredCache(Cache):
    """A transformers ``Cache`` backed by kvtier's tiered store.

    Args:
        config: the kvtier configuration.
        model: the model this cache serves. Gives the shape, dtype, device and fingerprint; the
            model is switched to kvtier's attention (as :func:`attach` does): budgeted decode in
            sparse mode, split prefills over a cached prefix in both modes, SDPA otherwise.
        model_config, num_layers, kv_heads, head_dim, dtype, device, fingerprint: used instead
            of (or to override) what ``model`` gives, for a cache built without a model.
        store: an open :class:`KVStore` of the same model to share (one store per model, one
            cache per conversation: prefixes are then shared through L1/L2 too); this cache
            does not close it. None: the cache makes its own store and closes it.
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
    ):
        if not isinstance(config, KVTierConfig):
            raise ValueError(f"config must be a kvtier.KVTierConfig, got {type(config).__name__}")
        if model is not None:
            model_config = model_config or model.config
            param = next(model.parameters())
            dtype = dtype or param.dtype
            device = device or param.device
            fingerprint = fingerprint if fingerprint is not None else model_fingerprint(model)
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
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype = dtype  # what attention receives (the store may keep another dtype: config.dtype)
        self.device = device
        if store is None:
            self.store = KVStore(config, num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim,
                                 dtype=dtype, device=device, fingerprint=self.fingerprint)
            self._finalizer = weakref.finalize(self, self.store.close)
        else:
            if not isinstance(store, KVStore):
                raise ValueError(f"store must be a kvtier KVStore or None; got {type(store).__name__}")
            if (store.num_layers, store.kv_heads, store.head_dim) != (num_layers, kv_heads, head_dim) \
                    or store.fingerprint != self.fingerprint or store.cfg != config:
                raise ValueError("store must belong to the same model (shape, fingerprint) and config")
            self.store = store
            self._finalizer = weakref.finalize(self, lambda: None)
        super().__init__(layers=[TieredLayer(self, i) for i in range(num_layers)])
        self.seqs: list[int] = []
        self._sparse = config.attention == "sparse"
        self._observe = self._sparse and config.policy in _OBSERVING_POLICIES
        self._budget = self.store.budget_tokens
        self._pending: tuple[int, str] | None = None
        # dense mode, a multi-token step over cached tokens: (layer, the K update() returned),
        # for kvtier's attention to recognise that call; a hint, ignored if the model uses another
        self._split: tuple[int, weakref.ref] | None = None
        # token ids of the forward in flight (set by the pre-hook), noted at its layer-0 update
        self._next_ids: torch.Tensor | None = None
        self._ids_ok = bool(self.fingerprint)  # False once a forward came without ids
        self._observed: list[tuple[int, int, list[int], torch.Tensor]] = []
        self._counters = dict(forwards=0, decode_steps=0, sparse_steps=0, dense_steps=0,
                              attended_tokens=0, context_tokens=0, selected_blocks=0, copied_sequences=0)
        if model is not None:
            _register_ids_hook(model)
            switch_attention(model)

    # -- the update path ------------------------------------------------------------------------

    def _update(self, layer: TieredLayer, k: torch.Tensor, v: torch.Tensor):
        if self._pending is not None:
            raise RuntimeError(
                f"TieredCache: layer {self._pending[0]} appended in sparse mode but kvtier's attention "
                f"never ran for it; use kvtier.attach(model, config) (or TieredCache(config, model)) so "
                f"the model attends through attn_implementation='kvtier'")
        b, h, t, d = k.shape
        l = layer.layer_idx
        if not self.seqs:
            if l != 0 or b < 1:
                raise ValueError(f"first update must be layer 0 with batch >= 1; got layer {l}, batch {b}")
            self.seqs = [self.store.add_sequence() for _ in range(b)]
        elif b != len(self.seqs):
            raise ValueError(f"batch size must stay {len(self.seqs)} for this cache; got {b}")
        if h != self.kv_heads or d != self.head_dim:
            raise ValueError(f"key states must be [batch, {self.kv_heads}, t, {self.head_dim}]; got {tuple(k.shape)}")
        if not layer.is_initialized:
            layer.lazy_initialization(k, v)
        past = layer.length
        store = self.store
        if l == 0:
            self._note_ids(t, past)
        for row, seq in enumerate(self.seqs):
            store.append(seq, l, k[row], v[row])  # [kv_heads, t, head_dim]
        layer.length = past + t
        if l == 0:
            self._counters["forwards"] += 1
            if t == 1 and past > 0:
                self._counters["decode_steps"] += 1
        if self._sparse:
            _attn.set_active(self)
            if t == 1 and past > 0:
                self._pending = (l, "sparse")
                return k, v
            self._pending = (l, "dense")
        out = (k, v) if past == 0 else self._gather(l)
        if not self._sparse:
            if t > 1 and past > 0:
                _attn.set_active(self)
                self._split = (l, weakref.ref(out[0]))
            self._layer_done(l, layer.length)
        return out

    # -- token ids and prefix reuse ------------------------------------------------------------------

    def set_input_ids(self, input_ids: torch.Tensor | None) -> None:
        """Token ids of the next forward ([batch, t], what ``input_ids`` holds); the pre-hook of
        :func:`attach` calls this. They are noted in the store when that forward appends."""
        self._next_ids = input_ids

    def _note_ids(self, t: int, past: int) -> None:
        """Note the ids of this forward, only while every earlier token's ids were noted (a gap
        would shift every later block's key): afterwards blocks keep process-local keys."""
        ids, self._next_ids = self._next_ids, None
        if not self._ids_ok:
            return
        store = self.store
        if ids is None or ids.dim() != 2 or ids.shape != (len(self.seqs), t) \
                or any(store.tokens_noted(seq) != past for seq in self.seqs):
            self._ids_ok = False
            return
        for row, seq in enumerate(self.seqs):
            store.note_tokens(seq, ids[row])

    def note_tokens(self, input_ids: torch.Tensor) -> None:
        """Explicitly give the ids of the next forward (when the model is not :func:`attach`-ed)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("input_ids must be a [batch, t] tensor of token ids")
        self.set_input_ids(input_ids)

    def load_prefix(self, input_ids: torch.Tensor) -> int:
        """Link the longest stored prefix of ``input_ids`` into this (empty) cache, before prefill.

        Every row gets the same number of tokens (the shortest match), whole blocks, and always
        less than the prompt so the forward computes at least the last token's logits. Then
        ``generate(input_ids, past_key_values=cache)`` feeds only ``input_ids[:, n:]`` (a direct
        ``model(...)`` call must pass that slice itself).

        Args:
            input_ids: [batch, T] token ids of the whole prompt.
        Returns:
            n, the tokens found (0 when nothing is stored, or the cache has no fingerprint).
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError("input_ids must be a [batch, T] tensor of token ids with T >= 1")
        if self.get_seq_length() or any(self.store.seq_len(s, 0) for s in self.seqs):
            raise ValueError("load_prefix needs an empty cache (call it before the prefill, or reset())")
        if not self.fingerprint:
            return 0
        store = self.store
        rows = input_ids[:, :-1].cpu()
        if not self.seqs:
            self.seqs = [store.add_sequence() for _ in range(rows.shape[0])]
        elif len(self.seqs) != rows.shape[0]:
            raise ValueError(f"batch size must stay {len(self.seqs)} for this cache; got {rows.shape[0]}")
        if len(self.seqs) == 1:  # one row: attach reads as far as it finds (one pass, L4 batched)
            n = store.attach_prefix(self.seqs[0], rows[0])
        else:
            n = min(store.match_prefix(r) for r in rows)
            for _ in range(3):
                got = [store.attach_prefix(seq, r[:n]) for seq, r in zip(self.seqs, rows)] if n else []
                if not got or min(got) == max(got) == n:
                    break
                # a block vanished between match and attach (L3 reclaimed it, the server evicted
                # it): start the rows again with what every row got
                n = min(got)
                for seq in self.seqs:
                    store.drop_sequence(seq)
                self.seqs = [store.add_sequence() for _ in range(rows.shape[0])]
            else:
                raise RuntimeError("load_prefix: the stored prefix kept changing while being attached")
        if n == 0:
            return 0
        for layer in self.layers:
            layer.device = self.device
            layer.is_initialized = True
            layer.length = n
        store.end_step()
        self._counters["prefix_tokens"] = self._counters.get("prefix_tokens", 0) + n
        return n

    def _gather(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token of layer ``l`` for the whole batch: K, V [batch, kv_heads, T, head_dim]."""
        store = self.store
        if len(self.seqs) == 1:
            k, v = store.gather(self.seqs[0], l)
            k, v = k.unsqueeze(0), v.unsqueeze(0)
        else:
            ks, vs = zip(*(store.gather(s, l) for s in self.seqs))
            k, v = torch.stack(ks), torch.stack(vs)
        if k.dtype != self.dtype:
            k, v = k.to(self.dtype), v.to(self.dtype)
        return k, v

    def _layer_done(self, l: int, attended: int) -> None:
        if l == 0:
            self._counters["context_tokens"] += self.layers[0].length
        self._counters["attended_tokens"] += attended
        if l == self.num_layers - 1:
            if self._observed:
                for seq, layer, sel, mass in self._observed:
                    self.store.observe(seq, layer, sel, mass)
                self._observed.clear()
            self.store.end_step()

    # -- called by kvtier's attention function --------------------------------------------------

    def pending_for(self, layer_idx: int | None, key: torch.Tensor | None = None) -> str | None:
        """Claim the pending step of ``layer_idx``: "sparse", "dense" (sparse mode), "split"
        (dense mode, a multi-token step over cached tokens whose K is ``key``), or None."""
        if self._pending is None:
            split, self._split = self._split, None
            if split is not None and split[0] == layer_idx and key is not None and split[1]() is key:
                return "split"
            return None
        l, kind = self._pending
        assert l == layer_idx, f"kvtier attention ran for layer {layer_idx} while layer {l} was pending"
        self._pending = None
        return kind

    def after_dense_attention(self, l: int, query: torch.Tensor) -> None:
        """After a multi-token step in sparse mode: seed H2O/SnapKV from the last queries."""
        if self._observe:
            w = min(query.shape[2], self.config.block_tokens)
            for row, seq in enumerate(self.seqs):
                self.store.observe_queries(seq, l, query[row, :, -w:])  # [q_heads, w, head_dim]
        if l == 0:
            self._counters["dense_steps"] += 1
        self._layer_done(l, self.layers[l].length)

    def sparse_attention(self, l: int, query: torch.Tensor, attention_mask: torch.Tensor | None,
                         scaling: float) -> torch.Tensor:
        """Budgeted attention of a one-token step over the blocks chosen with ``query``.

        Args:
            query: [batch, q_heads, 1, head_dim]; attention_mask: bool [batch|1, 1, 1, T] or None.
        Returns:
            [batch, 1, q_heads, head_dim].
        """
        store = self.store
        sels, ks, vs, ps = [], [], [], []
        for row, seq in enumerate(self.seqs):
            sel = store.select(seq, l, query[row], self._budget)  # query[row]: [q_heads, 1, head_dim]
            # views of L1 ([kv_heads, n, head_dim], pos [n]), valid until this layer's next store
            # call: consumed below (stacked/padded or attended) before that; sel: their block order
            k, v, pos, sel = store.gather_view(seq, l, sel)
            sels.append(sel)
            ks.append(k)
            vs.append(v)
            ps.append(pos)
        lens = [p.numel() for p in ps]
        n = max(lens)
        if len(ks) == 1:
            k, v, pos = ks[0].unsqueeze(0), vs[0].unsqueeze(0), ps[0].unsqueeze(0)
        elif min(lens) == n:
            k, v, pos = torch.stack(ks), torch.stack(vs), torch.stack(ps)
        else:  # rows attend different counts: pad, and mask the padding out below
            k = query.new_zeros((len(ks), self.kv_heads, n, self.head_dim), dtype=ks[0].dtype)
            v = torch.zeros_like(k)
            pos = torch.zeros((len(ks), n), dtype=torch.long, device=ps[0].device)
            for row, (kr, vr, pr) in enumerate(zip(ks, vs, ps)):
                k[row, :, : pr.numel()] = kr
                v[row, :, : pr.numel()] = vr
                pos[row, : pr.numel()] = pr
        if k.dtype != query.dtype:
            k, v = k.to(query.dtype), v.to(query.dtype)
        mask = None
        if attention_mask is not None:
            m = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
            m = m.expand(len(ks), 1, m.shape[2], m.shape[3])  # [B, 1, q_len, T]
            idx = pos.to(m.device)[:, None, None, :].expand(-1, 1, m.shape[2], -1)  # [B, 1, q_len, n]
            mask = torch.gather(m, 3, idx)
        if min(lens) != n:
            valid = torch.arange(n, device=k.device)[None, :] < torch.tensor(lens, device=k.device)[:, None]
            valid = valid[:, None, None, :]  # [B, 1, 1, n]
            mask = valid if mask is None else mask & valid
        out, mass = _attn.attend_blocks(query, k, v, mask, scaling)  # out [B, 1, q_heads, D], mass [B, n]
        if self._observe:
            bt = self.config.block_tokens
            for row, seq in enumerate(self.seqs):
                nb = len(sels[row])  # the gathered blocks in gather_view's order, the open one last
                mrow = torch.nn.functional.pad(mass[row, : lens[row]], (0, nb * bt - lens[row]))
                # per block, the open one last; handed to the store at the end of the step, so
                # reading it back (a device sync on CUDA) happens once per step, not per layer
                self._observed.append((seq, l, sels[row], mrow.view(nb, bt).sum(1)))
        c = self._counters
        if l == 0:
            c["sparse_steps"] += 1
        c["selected_blocks"] += sum(len(s) - 1 for s in sels)  # the open block is not selected
        self._layer_done(l, n)
        return out

    # -- batch manipulation ------------------------------------------------------------------------

    def _copy_sequence(self, src: int) -> int:
        dst = self.store.add_sequence()
        for l in range(self.num_layers):
            if self.store.seq_len(src, l):
                k, v = self.store.gather(src, l)
                self.store.append(dst, l, k, v)
        self._counters["copied_sequences"] += 1
        return dst

    def _rebatch(self, rows: list[int], method: str) -> None:
        """New batch whose row i is old row ``rows[i]``; repeated rows are copied."""
        n = len(self.seqs)
        if not n:
            return
        if any(not 0 <= r < n for r in rows):
            raise ValueError(f"{method}: indices must be in [0, {n}); got {rows}")
        keep = set(rows)
        for r in range(n):
            if r not in keep:
                self.store.drop_sequence(self.seqs[r])
        seen: set[int] = set()
        new = []
        for r in rows:
            seq = self.seqs[r]
            new.append(self._copy_sequence(seq) if r in seen else seq)
            seen.add(r)
        self.seqs = new

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes old row ``beam_idx[i]``."""
        self._rebatch([int(i) for i in beam_idx.tolist()], "reorder_cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        rows = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
        if rows and isinstance(rows[0], bool):
            rows = [i for i, keep in enumerate(rows) if keep]
        self._rebatch([int(i) for i in rows], "batch_select_indices")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be an int >= 1; got {repeats!r}")
        self._rebatch([r for r in range(len(self.seqs)) for _ in range(repeats)], "batch_repeat_interleave")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise NotImplementedError(
            "TieredCache.crop: sealed blocks are immutable and may already be quantized in L2/L3; "
            "the store cannot truncate a sequence")

    def reset(self) -> None:
        """Forget every sequence (the store and its tiers stay open for the next batch). Their
        content-addressed blocks stay in L3 for :meth:`load_prefix` of a later conversation,
        until L3 needs the room."""
        for seq in self.seqs:
            self.store.drop_sequence(seq, keep_prefix=True)
        self.seqs = []
        self._next_ids = None
        self._ids_ok = bool(self.fingerprint)
        self._pending = None
        self._split = None
        self._observed.clear()
        for layer in self.layers:
            layer.reset()

    def offload(self, layer_idx: int, only_non_sliding: bool = True):
        raise NotImplementedError("TieredCache.offload: kvtier moves blocks between tiers itself")

    # -- reporting and lifecycle -------------------------------------------------------------------

    def stats(self) -> dict:
        """The store's statistics plus this cache's own (JSON-serialisable)."""
        s = self.store.stats()
        c = dict(self._counters)
        ctx = c["context_tokens"] * self.num_layers
        c["attended_fraction"] = (c["attended_tokens"] / ctx) if ctx else None
        c["batch"] = len(self.seqs)
        c["seq_length"] = self.get_seq_length()
        s["integration"] = c
        return s

    def close(self) -> None:
        """Close the store (worker threads, files). The cache must not be used afterwards."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"TieredCache(layers={self.num_layers}, batch={len(self.seqs)}, "
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
        if isinstance(existing_cache, TieredCache):
            raise ValueError("existing_cache is already a TieredCache")
        if not isinstance(existing_cache, Cache):
            raise ValueError(f"existing_cache must be a transformers Cache (DynamicCache); got {type(existing_cache).__name__}")
        layers = existing_cache.layers
        if not layers or any(getattr(ly, "is_sliding", False) for ly in layers):
            raise ValueError("existing_cache must have full-attention layers (no sliding window)")
        first = next((ly for ly in layers if ly.is_initialized and ly.keys is not None and ly.keys.numel()), None)
        if first is None:
            raise ValueError("existing_cache is empty: nothing to take over (pass the TieredCache to the prefill instead)")
        for ly in layers:
            if type(ly) is not DynamicLayer:
                raise ValueError(f"existing_cache layers must be DynamicLayer; got {type(ly).__name__}")
        b, kvh, t, hd = first.keys.shape
        cache = cls(config, model, num_layers=len(layers), kv_heads=kvh, head_dim=hd,
                    dtype=first.keys.dtype, device=first.keys.device)
        cache.seqs = [cache.store.add_sequence() for _ in range(b)]
        for l, ly in enumerate(layers):
            if ly.keys is None or ly.keys.shape[-2] != t:
                raise ValueError(f"existing_cache layers must all hold {t} tokens; layer {l} differs")
            for row, seq in enumerate(cache.seqs):
                cache.store.append(seq, l, ly.keys[row], ly.values[row])  # [kv_heads, t, head_dim]
            cache.layers[l].lazy_initialization(ly.keys, ly.values)
            cache.layers[l].length = t
        cache.store.end_step()
        if release:
            for ly in layers:
                ly.reset()
        return cache

    def save(self, path) -> None:
        """Write this conversation to an HDF5 file (see :mod:`kvtier.integrations.persist`)."""
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


def switch_attention(model) -> None:
    """Register kvtier's attention and make ``model`` use it (previous choice kept for :func:`detach`).

    Without a TieredCache step to finish, kvtier's attention is transformers' SDPA, so the
    switched model still runs with any cache."""
    name = _attn.register()
    current = model.config._attn_implementation
    if current != name:
        model._kvtier_previous_attn = current
        model.set_attn_implementation(name)


def attach(model, config: KVTierConfig, *, store: KVStore | None = None) -> TieredCache:
    """A :class:`TieredCache` bound to ``model``, which then attends through kvtier's attention.

    Pass the result as ``past_key_values=`` (or ``cache=``) to ``model.generate`` / ``model(...)``.
    A forward pre-hook on ``model`` (registered once by any TieredCache built with a model) hands
    each forward's ``input_ids`` to the TieredCache it is given, so the store learns the token
    ids (content-addressed keys, prefix reuse); :func:`detach` removes it.
    """
    return TieredCache(config, model, store=store)


def _ids_hook(module, args, kwargs):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, TieredCache):
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
            # padded rows: positions shift with the padding, so the same ids need not mean the
            # same K/V; such a cache stops giving ids (its blocks keep process-local keys)
            ids = None
        cache.set_input_ids(ids if isinstance(ids, torch.Tensor) else None)
    return None


def _register_ids_hook(model) -> None:
    if getattr(model, "_kvtier_ids_hook", None) is None:
        model._kvtier_ids_hook = model.register_forward_pre_hook(_ids_hook, with_kwargs=True)


def detach(model) -> None:
    """Give ``model`` back the attention implementation it had before :func:`attach`."""
    hook = getattr(model, "_kvtier_ids_hook", None)
    if hook is not None:
        hook.remove()
        model._kvtier_ids_hook = None
    prev = getattr(model, "_kvtier_previous_attn", None)
    if prev is not None:
        model.set_attn_implementation(prev)
        del model._kvtier_previous_attn

