"""kvtier inside transformers: :class:`~kvtier.hf.cache.TieredCache`, a transformers ``Cache`` whose
layers live in a :class:`kvtier.store.KVStore`, and :func:`~kvtier.hf.cache.attach`, which builds one
for a model and switches the model to kvtier's attention (``kvtier.attach`` and
``kvtier.TieredCache`` are these).

```
 cache.py      TieredCache: the Cache API transformers calls, attach()
 layer.py      TieredLayer: one model layer (CacheLayerMixin); K/V gathered from the store
 rows.py       batch rows -> store sequences (all-or-nothing rebatching, forks)
 prefix.py     token ids of each forward -> content-addressed keys; linking a stored prefix
 steps.py      the forward in flight: begun, finished layer by layer, or rolled back
 hooks.py      forward hooks on the model: ids in, failed steps rolled back
 handover.py   what update() hands to kvtier's attention; the step in flight
 attention.py  kvtier's attention functions (registered with transformers)
 sparse.py     budgeted attention of a sparse decode step
 registry.py   one process-wide store per (model, L3 directory), shared by its caches
 takeover.py   TieredCache.wrap: a filled DynamicCache moved into the tiers
 persist.py    TieredCache.save / load: one conversation as an HDF5 file
```
In both modes a multi-token step over tokens already cached (the prefill after ``load_prefix``, a
chunked prefill, a speculative verification) may attend in two unmasked passes merged by
log-sum-exp instead of one SDPA over an explicit mask (``Handover(SPLIT)``,
:func:`.attention.split_prefix_attention`; only when the mask is exactly causal).

Nothing here imports vLLM; :mod:`kvtier.vllm` is the connector for vLLM.
"""
