"""The process-wide engine: one :class:`KVStore` per (model, disk directory), shared by its caches.

A cache per request or per conversation is the normal way to use kvtier, and every one of them
built for the same model and configuration lands on the same store, so prefixes are shared
through L1/L2/L3 and an L3 directory (which one process may open once: ``DiskTier`` locks it) is
opened once. The store is leased: each cache holds one :class:`StoreLease`, gives its sequences
back when it closes (``close()``, a ``with`` block, or garbage collection), and the store itself
closes when its last lease goes.

```
 attach(model, cfg) ─┐                      key = (fingerprint, shape, dtype, device,
 TieredCache(cfg, m) ├─► lease(...) ──► _stores[key] ──► KVStore   disk directory | config)
 wrap / load / fork ─┘       refs + 1                   closed when refs drop to 0
```
A store passed explicitly (``store=``) is used as it is: a registry store is leased like any
other, a store the caller built stays the caller's to close.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, fields

import torch

from kvtier.config import KVTierConfig
from kvtier.store import KVStore

_lock = threading.Lock()  # guards _stores and every _Entry.refs
_stores: dict[tuple, "_Entry"] = {}


@dataclass(eq=False)
class _Entry:
    key: tuple
    store: KVStore
    refs: int = 0


class StoreLease:
    """One cache's hold on a store; :meth:`release` (idempotent) gives it back."""

    def __init__(self, store: KVStore, entry: _Entry | None) -> None:
        self.store = store
        self._entry = entry  # None: a store the caller owns (never closed here)
        self._held = True

    def release(self) -> None:
        with _lock:
            if not self._held:
                return
            self._held = False
            e = self._entry
            if e is None:
                return
            e.refs -= 1
            last = e.refs == 0
            if last and _stores.get(e.key) is e:
                del _stores[e.key]
        if last:
            e.store.close()


def _disk_key(cfg: KVTierConfig) -> str | None:
    return None if cfg.disk_path is None else os.path.realpath(os.path.expanduser(cfg.disk_path))


def _differences(a: KVTierConfig, b: KVTierConfig) -> list[str]:
    return [f.name for f in fields(a) if getattr(a, f.name) != getattr(b, f.name)]


def _join(e, cfg: KVTierConfig, whose: str) -> StoreLease:
    """Another lease on the open store ``e``, which must have been opened with ``cfg``."""
    if e.store.cfg != cfg:
        raise ValueError(
            f"disk_path {cfg.disk_path!r} is in use in this process by the kvtier store of "
            f"{whose} with another configuration (fields that differ: "
            f"{', '.join(_differences(e.store.cfg, cfg))}). Use the same KVTierConfig for "
            f"every cache of this model, close the other caches first (cache.close(), or a "
            f"`with` block), or give this configuration another disk_path")
    e.refs += 1
    return StoreLease(e.store, e)


def lease(cfg: KVTierConfig, *, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
          device: torch.device, fingerprint: str) -> StoreLease:
    """A lease on the process's store for this model and configuration (opened on first use).

    Raises:
        ValueError: the configuration's ``disk_path`` is held in this process by a store of
            another model or configuration (naming what differs and the way out).
    """
    disk = _disk_key(cfg)
    model = (fingerprint, num_layers, kv_heads, head_dim, str(dtype), str(torch.device(device)))
    # without a disk directory nothing is exclusive: stores of other configurations coexist
    key = model + ((disk,) if disk is not None else (None, cfg))
    with _lock:
        e = _stores.get(key)
        if e is not None and e.store.closed:  # closed by hand (cache.store.close()): start over
            del _stores[key]
            e = None
        if e is not None:
            return _join(e, cfg, "this model")
        holder = next((o for k, o in _stores.items() if disk is not None and k[6] == disk), None)
        if holder is not None and not fingerprint and holder.key[1:6] == model[1:6] \
                and not holder.store.closed:
            # a cache built without a model (wrap(dynamic_cache, cfg)) has no fingerprint and so
            # never gives token ids: its blocks stay private, and the store of the same shape,
            # dtype and device already serving this directory can hold them
            return _join(holder, cfg, "this model shape")
        if holder is not None:
            raise ValueError(
                f"disk_path {cfg.disk_path!r} is in use in this process by the kvtier store of another "
                f"model (fingerprint {holder.key[0]!r}, layers/heads/head_dim {holder.key[1:4]}, "
                f"dtype {holder.key[4]}); one L3 directory serves one model per process: close that "
                f"model's caches first (cache.close(), or a `with` block), or give this one another "
                f"disk_path" + ("" if holder.key[0] else " (that store's caches were built without "
                               "model=: pass the model to TieredCache.wrap / load as well)"))
        store = KVStore(cfg, num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim,
                        dtype=dtype, device=device, fingerprint=fingerprint)
        e = _stores[key] = _Entry(key, store, refs=1)
        return StoreLease(store, e)


def lease_existing(store: KVStore) -> StoreLease:
    """A lease on a store given explicitly: counted if the registry opened it, else borrowed."""
    with _lock:
        for e in _stores.values():
            if e.store is store:
                e.refs += 1
                return StoreLease(store, e)
    return StoreLease(store, None)


def open_stores() -> list[KVStore]:
    """The stores this process's caches hold now (for tests and diagnostics)."""
    with _lock:
        return [e.store for e in _stores.values()]
