"""Taking over a filled transformers cache: its K and V move into a new TieredCache's store."""
from __future__ import annotations

from transformers.cache_utils import Cache, DynamicLayer

from kvtier.config import KVTierConfig


def take_over(cls, existing_cache: Cache, config: KVTierConfig, model=None, *, release: bool = True):
    """:meth:`TieredCache.wrap` (see there); ``cls`` is the TieredCache class to build."""
    if isinstance(existing_cache, cls):
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
    for l, ly in enumerate(layers):
        if ly.keys is None or ly.keys.shape[-2] != t:
            raise ValueError(f"existing_cache layers must all hold {t} tokens; layer {l} differs")
    cache = cls(config, model, num_layers=len(layers), kv_heads=kvh, head_dim=hd,
                dtype=first.keys.dtype, device=first.keys.device)
    try:
        cache._rows.register(b)
        for l, ly in enumerate(layers):
            for row, seq in enumerate(cache._rows.seqs):
                cache.store.append(seq, l, ly.keys[row], ly.values[row])  # [kv_heads, t, head_dim]
        cache._filled(t)
    except BaseException:
        cache.close()
        raise
    cache.store.end_step()
    if release:
        for ly in layers:
            ly.reset()
    return cache
