"""kvtier inside vLLM: ``KVTierConnector``, a KV connector that stores vLLM's full KV blocks
quantized in kvtier's tiers (L2 DRAM, L3 SSD segments, L4 Redis) and loads matched prefixes back.

```python
from vllm import LLM
llm = LLM(model=..., kv_transfer_config={
    "kv_connector": "KVTierConnector",
    "kv_connector_module_path": "kvtier.integrations.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"codec": "int8", "disk_path": "/var/cache/kvtier"},
})
```
Importing this package does not import vLLM; ``KVTierConnector`` (in ``connector.py``, the only
module that imports it) is loaded on first access. ``blocks.py`` and ``lookup.py`` are vLLM-free.
"""
from __future__ import annotations

__all__ = ["KVTierConnector", "KVTierMetadata", "worker_call"]


def __getattr__(name: str):
    if name in ("KVTierConnector", "KVTierMetadata"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def worker_call(engine_id: str, op: str) -> dict:
    """Ask the worker of engine ``engine_id`` (``llm.llm_engine.vllm_config.kv_transfer_config.engine_id``)
    for ``"stats"`` (its store's counters, bytes per token) or ``"flush"`` (wait for queued saves)."""
    from .lookup import LookupClient, socket_path

    if op not in ("stats", "flush"):
        raise ValueError(f"op must be 'stats' or 'flush'; got {op!r}")
    client = LookupClient(socket_path(engine_id), connect_timeout_s=5.0)
    try:
        return client.call({"op": op})
    finally:
        client.close()
