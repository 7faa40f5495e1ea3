"""kvtier's counters in a real engine's own metrics: the connector's stats travel from the worker
through vLLM's scheduler stats to its Prometheus registry (what ``vllm serve`` shows at
``/metrics``; ``LLM.get_metrics()`` offline) and equal what the worker's store counted.

```
 P1 = prefix + a         stored (4 blocks of 128 tokens, int8, L2 and L3)
 P1' = prefix + b        loads the 4 prefix blocks from L2
 cold (load/save off)    one more request, so the last step's counts reach the registry
```
"""
from __future__ import annotations

from prometheus_client import REGISTRY, generate_latest

from kvtier.vllm.counters import CONNECTOR_METRICS

from .helpers import engine, run, worker

BLOCK = 128
LAYERS = 30


def _kvtier_series(llm) -> dict[tuple[str, str | None], float]:
    """{(name, tier): value} of kvtier's series in the engine's registry."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:kvtier_"):
            out[(m.name, m.labels.get("tier"))] = m.value
    return out


def test_engine_registry_carries_kvtier_counters(model_dir, token_ids, tmp_path):
    prefix = token_ids[:4 * BLOCK]
    with engine(model_dir, log_stats=True, codec="int8", disk_path=str(tmp_path / "l3")) as llm:
        run(llm, prefix + token_ids[600:690])
        _, matched, _ = run(llm, prefix + token_ids[1500:1600])
        assert matched == 4 * BLOCK
        run(llm, token_ids[3000:3050], load=False, save=False)
        st = worker(llm, "stats")
        got = _kvtier_series(llm)
        text = generate_latest(REGISTRY).decode()

    assert st["loaded_blocks"] == 4 and st["l2_hits"] == 4 * LAYERS, st
    want = {("vllm:kvtier_loaded_blocks", None): st["loaded_blocks"],
            ("vllm:kvtier_saved_blocks", None): st["saved_blocks"],
            ("vllm:kvtier_stored_bytes", None): st["stored_bytes"],
            ("vllm:kvtier_lookups", None): st["lookups"],
            ("vllm:kvtier_lookup_hit_blocks", None): st["lookup_hits"],
            ("vllm:kvtier_load_failures", None): 0,
            ("vllm:kvtier_loaded_records", "l2"): st["l2_hits"],
            ("vllm:kvtier_loaded_records", "l3"): 0,
            ("vllm:kvtier_tier_used_bytes", "l2"): st["tiers"]["l2"]["used_bytes"],
            ("vllm:kvtier_tier_used_bytes", "l3"): st["tiers"]["l3"]["used_bytes"]}
    for key, value in want.items():
        assert got.get(key) == value, (key, got.get(key), value)
    assert st["saved_blocks"] == 4 and st["lookup_hits"] >= 4  # P1's blocks: loaded, not stored again
    # what was written to L2 and L3 and read back from L2, in bytes
    assert got[("vllm:kvtier_tier_written_bytes", "l3")] >= st["stored_bytes"] > 0
    assert got[("vllm:kvtier_tier_read_bytes", "l2")] > 0
    # every series kvtier defines is in the exposition vLLM's /metrics serves
    for name, (kind, _, _) in CONNECTOR_METRICS.items():
        assert (name + "_total" if kind == "counter" else name) in text, name
    assert 'vllm:kvtier_loaded_blocks_total{engine="0"' in text
