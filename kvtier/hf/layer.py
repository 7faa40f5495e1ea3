"""TieredLayer: one model layer of a TieredCache, as transformers' ``CacheLayerMixin``."""
from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import CacheLayerMixin


class TieredLayer(CacheLayerMixin):
    """One model layer of a :class:`TieredCache`; the tokens live in the store, not here.

    ``keys`` / ``values`` are what a ``DynamicLayer`` holds, ``[batch, kv_heads, T, head_dim]``,
    gathered from the store on every access: a copy (blocks below L1 are read back), so writing
    into it changes nothing and each access costs a dense read of the layer.
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False
    supports_early_init = False

    def __init__(self, cache, layer_idx: int):
        # A weak reference: the cache owns its layers, not the other way round.
        self._cache_ref = weakref.ref(cache)
        self.layer_idx = layer_idx
        self.length = 0
        super().__init__()

    def _kv(self, half: int) -> torch.Tensor | None:
        cache = self._cache_ref()
        if cache is None or not self.length:
            return None
        return cache._gather(self.layer_idx)[half]

    def _read_only(self, value) -> None:
        if value is not None:  # CacheLayerMixin.__init__ clears them
            raise AttributeError("TieredLayer keys/values are gathered from the store (a copy); "
                                 "append through update()")

    keys = property(lambda self: self._kv(0), _read_only)
    values = property(lambda self: self._kv(1), _read_only)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``[batch, kv_heads, t, head_dim]`` states; return what attention should see.

        ``kwargs["kwargs"]`` is the attention call's kwargs dict (transformers passes it), where
        a hand-over to kvtier's attention goes."""
        attn_kwargs = kwargs.get("kwargs")
        return self._cache_ref()._update(self, key_states, value_states,
                                         attn_kwargs if isinstance(attn_kwargs, dict) else None)

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
        raise NotImplementedError("TieredLayer.crop: call TieredCache.crop (every layer is cut together)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("TieredLayer.reorder_cache: call TieredCache.reorder_cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("TieredLayer.batch_repeat_interleave: call TieredCache.batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("TieredLayer.batch_select_indices: call TieredCache.batch_select_indices")
