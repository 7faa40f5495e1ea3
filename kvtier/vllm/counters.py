"""What the connector reports to vLLM's metrics (vLLM-free: ``metrics.py`` holds the vLLM classes).

The worker sends, after each step, what its :class:`~.blocks.BlockStore` counted since the
previous step (:class:`Deltas`); vLLM sums those on the way to its stats logger and its
Prometheus registry (``vllm serve``'s ``/metrics``), where they are the series of
:data:`CONNECTOR_METRICS`. A payload is a plain dict (vLLM ships it between processes):
``{"counters": {key: n}, "gauges": {key: n}}``, a key being a metric name, or ``name/tier``.
"""
from __future__ import annotations

#: name -> (kind, tier label values or (), help). Counters are named without ``_total``
#: (prometheus_client adds it); vLLM adds its ``model_name`` and ``engine`` labels.
CONNECTOR_METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "vllm:kvtier_lookups": ("counter", (), "prefix lookups the scheduler asked kvtier for"),
    "vllm:kvtier_lookup_hit_blocks": ("counter", (), "leading blocks those lookups found stored"),
    "vllm:kvtier_saved_blocks": ("counter", (), "vLLM blocks encoded and stored"),
    "vllm:kvtier_stored_bytes": ("counter", (), "encoded bytes of those blocks (every layer)"),
    "vllm:kvtier_loaded_blocks": ("counter", (), "vLLM blocks loaded from kvtier instead of computed"),
    "vllm:kvtier_load_failures": ("counter", (), "requests with a block that failed to load (recomputed)"),
    "vllm:kvtier_loaded_records": ("counter", ("l2", "l3", "l4"), "block-layer records loaded, by the tier "
                                                                   "that supplied them"),
    "vllm:kvtier_tier_written_bytes": ("counter", ("l2", "l3"), "bytes written into each tier"),
    "vllm:kvtier_tier_read_bytes": ("counter", ("l2", "l3"), "bytes read out of each tier"),
    "vllm:kvtier_l3_evictions": ("counter", (), "L3 records evicted to stay under disk_bytes"),
    "vllm:kvtier_l3_admission_refusals": ("counter", (), "records L3's admission policy turned away"),
    "vllm:kvtier_l3_compactions": ("counter", (), "L3 segment compactions"),
    "vllm:kvtier_l3_crc_failures": ("counter", (), "L3 records that failed their check (read or open scan)"),
    "vllm:kvtier_tier_used_bytes": ("gauge", ("l2", "l3"), "bytes each tier holds"),
    "vllm:kvtier_l3_free_bytes": ("gauge", (), "L3 capacity left (disk_bytes minus live bytes)"),
}


def _key(name: str, tier: str | None = None) -> str:
    return name if tier is None else f"{name}/{tier}"


def snapshot(store) -> dict:
    """The payload of everything ``store`` (a :class:`~.blocks.BlockStore`) counted so far."""
    s = store.stats()
    c = {_key("vllm:kvtier_lookups"): s["lookups"], _key("vllm:kvtier_lookup_hit_blocks"): s["lookup_hits"],
         _key("vllm:kvtier_saved_blocks"): s["saved_blocks"], _key("vllm:kvtier_stored_bytes"): s["stored_bytes"],
         _key("vllm:kvtier_loaded_blocks"): s["loaded_blocks"],
         _key("vllm:kvtier_load_failures"): s["load_failures"]}
    for t in ("l2", "l3", "l4"):
        c[_key("vllm:kvtier_loaded_records", t)] = s[f"{t}_hits"]
    g = {}
    for t, tier in (("l2", store.l2), ("l3", store.l3)):
        if tier is None:
            continue
        ts = tier.stats()
        c[_key("vllm:kvtier_tier_written_bytes", t)] = ts["bytes_in"]
        c[_key("vllm:kvtier_tier_read_bytes", t)] = ts["bytes_out"]
        g[_key("vllm:kvtier_tier_used_bytes", t)] = ts["used_bytes"]
        if t == "l3":
            c[_key("vllm:kvtier_l3_evictions")] = ts["evictions"]
            c[_key("vllm:kvtier_l3_admission_refusals")] = ts["admission_refused"]
            c[_key("vllm:kvtier_l3_compactions")] = ts["compactions"]
            c[_key("vllm:kvtier_l3_crc_failures")] = ts["corrupt"] + ts["scan_corrupt"]
            g[_key("vllm:kvtier_l3_free_bytes")] = max(0, ts["capacity_bytes"] - ts["used_bytes"])
    return {"counters": c, "gauges": g}


class Deltas:
    """What a store counted since the previous :meth:`take` (one per worker)."""

    def __init__(self, store) -> None:
        self._store = store
        self._last: dict = {"counters": {}, "gauges": {}}

    def take(self) -> dict | None:
        """The counters' growth since the last call and the gauges' values; None when nothing
        changed (vLLM then sends nothing)."""
        now = snapshot(self._store)
        last, self._last = self._last, now
        grown = {k: v - last["counters"].get(k, 0) for k, v in now["counters"].items()}
        grown = {k: v for k, v in grown.items() if v}
        if not grown and now["gauges"] == last["gauges"]:
            return None
        return {"counters": grown, "gauges": dict(now["gauges"])}


def merge(a: dict, b: dict) -> dict:
    """Two payloads as one: counters summed, gauges from ``b`` (the later one) where it has them."""
    c = dict(a.get("counters", {}))
    for k, v in b.get("counters", {}).items():
        c[k] = c.get(k, 0) + v
    return {"counters": c, "gauges": {**a.get("gauges", {}), **b.get("gauges", {})}}


def split_key(key: str) -> tuple[str, str | None]:
    """``(metric name, tier or None)`` of a payload key."""
    name, _, tier = key.partition("/")
    return name, tier or None
