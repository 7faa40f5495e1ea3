"""kvtier: tiered, quantized KV-cache storage for long-context LLM inference.

Public names: ``KVTierConfig``, ``TieredCache``, ``attach``, ``SavedCacheError``. The transformers-facing names are
imported lazily so that the compress/tiers/store layers work without transformers installed.
"""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["KVTierConfig", "TieredCache", "attach", "SavedCacheError", "__version__"]


def __getattr__(name: str):
    if name == "KVTierConfig":
        from kvtier.config import KVTierConfig

        return KVTierConfig
    if name in ("TieredCache", "attach"):
        from kvtier.hf import cache as _cache

        return getattr(_cache, name)
    if name == "SavedCacheError":
        from kvtier.hf.persist import SavedCacheError

        return SavedCacheError
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
