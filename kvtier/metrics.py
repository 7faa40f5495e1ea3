"""Prometheus metrics of the process's kvtier stores (``prometheus_client``).

Nothing is counted on the decode path for this: :class:`KVTierCollector` reads each store's
``stats()`` (the counters and latency samples the store keeps anyway) when it is scraped.

```python
import kvtier.metrics
server = kvtier.metrics.serve(9400)            # http://127.0.0.1:9400/metrics, every open store
server.close()

from prometheus_client import CollectorRegistry
registry = CollectorRegistry()                  # or mount it in a registry of your own
registry.register(kvtier.metrics.KVTierCollector())          # every store this process opens
registry.register(kvtier.metrics.KVTierCollector([cache.store]))  # or only these
```
Every series carries ``store``, :func:`store_label`: the first 12 characters of the store's
content identity (model weights, codecs, layout, namespace) and its L3 directory.
:data:`METRICS` lists every name with its type, labels and meaning.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

TIERS_HIT = ("l1", "l2", "l3", "l4")

#: name -> (type, labels besides ``store``, help). Counters are named without ``_total``
#: (the exposition adds it); summaries have ``quantile`` (0.5, 0.99 of the recent samples),
#: ``_sum`` and ``_count``.
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "kvtier_store_info": ("gauge", ("model_fingerprint", "disk_path", "codec", "order", "policy", "attention"),
                          "1 per open store; its identity and configuration as labels"),
    "kvtier_hits": ("counter", ("tier",), "block reads served by each tier"),
    "kvtier_misses": ("counter", ("tier",), "block reads each tier could not serve"),
    "kvtier_tier_bytes": ("gauge", ("tier",), "bytes of this store's blocks held in each tier (L1: resident "
                                              "slots and sparse digests)"),
    "kvtier_tier_used_bytes": ("gauge", ("tier",), "bytes each tier has in use (its own accounting)"),
    "kvtier_tokens": ("gauge", (), "tokens of the live sequences, summed over layers"),
    "kvtier_sequences": ("gauge", (), "live sequences"),
    "kvtier_swap_in_bytes": ("counter", ("tier",), "encoded bytes read back from each tier below L1"),
    "kvtier_swap_out_bytes": ("counter", ("tier",), "encoded bytes written to each tier on eviction"),
    "kvtier_swap_in_blocks": ("counter", (), "blocks swapped into L1"),
    "kvtier_swap_out_blocks": ("counter", (), "blocks swapped out of L1"),
    "kvtier_swap_in_seconds": ("summary", (), "time to swap in one block (read and decode)"),
    "kvtier_swap_out_seconds": ("summary", (), "time to swap out one block (encode and write), on the worker"),
    "kvtier_step_seconds": ("summary", ("swapped",), "time between two decode steps (TPOT), split by "
                                                     "whether a block was swapped in during the step"),
    "kvtier_prefetch_issued": ("counter", (), "blocks prefetched"),
    "kvtier_prefetch_used": ("counter", (), "prefetched blocks a read used"),
    "kvtier_prefetch_wasted": ("counter", (), "prefetched blocks dropped unused"),
    "kvtier_prefix_lookup_tokens": ("counter", (), "prompt tokens looked up in the prefix store"),
    "kvtier_prefix_hit_tokens": ("counter", (), "prompt tokens found stored"),
    "kvtier_published_blocks": ("counter", ("tier",), "content-addressed blocks written to L3/L4 for sharing"),
    "kvtier_published_bytes": ("counter", ("tier",), "bytes of those blocks"),
    "kvtier_identity_refusals": ("counter", (), "stored blocks refused because their identity did not match "
                                                "(read as misses)"),
    "kvtier_l3_used_bytes": ("gauge", (), "live record bytes in L3"),
    "kvtier_l3_free_bytes": ("gauge", (), "L3 capacity left (capacity minus live bytes)"),
    "kvtier_l3_capacity_bytes": ("gauge", (), "L3 byte cap (disk_bytes)"),
    "kvtier_l3_file_bytes": ("gauge", (), "bytes the L3 segment files take on disk"),
    "kvtier_l3_records": ("gauge", (), "live L3 records"),
    "kvtier_l3_written_bytes": ("counter", (), "bytes written to L3 segment files (records, compaction, "
                                               "checkpoints)"),
    "kvtier_l3_evictions": ("counter", (), "L3 records evicted to stay under the cap"),
    "kvtier_l3_evicted_bytes": ("counter", (), "bytes of those records"),
    "kvtier_l3_offered": ("counter", (), "records offered to L3 under its admission policy"),
    "kvtier_l3_admission_refusals": ("counter", (), "offered records the admission policy turned away"),
    "kvtier_l3_compactions": ("counter", (), "L3 segment compactions"),
    "kvtier_l3_crc_failures": ("counter", ("phase",), "L3 records that failed their check: on a read, or in the "
                                                      "scan at open"),
    "kvtier_l3_disk_full_errors": ("counter", (), "L3 writes that found the disk full"),
}

_QUANTILES = (("0.5", "p50_ms"), ("0.99", "p99_ms"))


def store_label(store) -> str:
    """``<identity prefix>@<L3 directory>`` (``@memory`` without L3): the ``store`` label."""
    ident = (getattr(store, "content_fp", None) or store.fingerprint or "anonymous")[:12]
    disk = store.cfg.disk_path
    return f"{ident}@{os.path.realpath(os.path.expanduser(disk)) if disk is not None else 'memory'}"


class _Families:
    """The metric families of one scrape, created on first use, in :data:`METRICS` order."""

    def __init__(self) -> None:
        self._f: dict[str, Metric] = {}

    def add(self, name: str, store: str, value: float, **labels: str) -> None:
        kind, names, doc = METRICS[name]
        f = self._f.get(name)
        if f is None:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            f = self._f[name] = cls(name, doc, labels=("store", *names))
        f.add_metric([store, *(labels[n] for n in names)], value)

    def summary(self, name: str, store: str, lat: dict, **labels: str) -> None:
        """A summary from a latency dict of ``stats()`` (``count``, ``total_s``, ``p50_ms``, ...)."""
        kind, names, doc = METRICS[name]
        assert kind == "summary", name
        f = self._f.get(name)
        if f is None:
            f = self._f[name] = Metric(name, doc, "summary")
        base = {"store": store, **{n: labels[n] for n in names}}
        for q, key in _QUANTILES:
            # no samples yet: the quantile is unknown, not 0
            f.add_sample(name, {**base, "quantile": q}, lat[key] / 1e3 if lat["count"] else math.nan)
        f.add_sample(name + "_sum", base, lat["total_s"])
        f.add_sample(name + "_count", base, lat["count"])

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._f[name] for name in METRICS if name in self._f)


def _store_metrics(out: _Families, store, label: str) -> None:
    s = store.stats()
    cfg = s["config"]
    out.add("kvtier_store_info", label, 1, model_fingerprint=store.fingerprint or "",
            disk_path=store.cfg.disk_path or "", codec=str(store.cfg.codec), order=cfg["order"],
            policy=cfg["policy"], attention=cfg["attention"])
    remote = s["remote"]
    hits = dict(s["hits"], l4=remote["hits"] if remote else 0)
    misses = dict(s["misses"], l4=remote["misses"] if remote else 0)
    for tier in TIERS_HIT:
        if tier == "l4" and remote is None:
            continue
        out.add("kvtier_hits", label, hits[tier], tier=tier)
        out.add("kvtier_misses", label, misses[tier], tier=tier)
    for tier, n in s["bytes"].items():
        out.add("kvtier_tier_bytes", label, n, tier=tier)
    for tier, n in s["tier_used_bytes"].items():
        out.add("kvtier_tier_used_bytes", label, n, tier=tier)
    out.add("kvtier_tokens", label, s["tokens"])
    out.add("kvtier_sequences", label, s["sequences"])
    swap_in = dict(s["swap_in_bytes"], **({"l4": remote["swap_in_bytes"]} if remote else {}))
    for tier, n in swap_in.items():
        out.add("kvtier_swap_in_bytes", label, n, tier=tier)
    for tier, n in s["swap_out_bytes"].items():
        out.add("kvtier_swap_out_bytes", label, n, tier=tier)
    out.add("kvtier_swap_in_blocks", label, s["swap_in_blocks"])
    out.add("kvtier_swap_out_blocks", label, s["swap_out_blocks"])
    out.summary("kvtier_swap_in_seconds", label, s["swap_in_latency"])
    out.summary("kvtier_swap_out_seconds", label, s["swap_out_latency"])
    out.summary("kvtier_step_seconds", label, s["step_time_swapped"], swapped="yes")
    out.summary("kvtier_step_seconds", label, s["step_time_unswapped"], swapped="no")
    pf = s["prefetch"]
    out.add("kvtier_prefetch_issued", label, pf["issued"])
    out.add("kvtier_prefetch_used", label, pf["used"])
    out.add("kvtier_prefetch_wasted", label, pf["wasted"])
    px = s["prefix"]
    out.add("kvtier_prefix_lookup_tokens", label, px["lookup_tokens"])
    out.add("kvtier_prefix_hit_tokens", label, px["hit_tokens"])
    out.add("kvtier_published_blocks", label, px["published_l3"]["blocks"], tier="l3")
    out.add("kvtier_published_bytes", label, px["published_l3"]["bytes"], tier="l3")
    if remote:
        out.add("kvtier_published_blocks", label, remote["published_blocks"], tier="l4")
        out.add("kvtier_published_bytes", label, remote["published_bytes"], tier="l4")
    out.add("kvtier_identity_refusals", label, s["identity_refusals"])
    d = s["disk"]
    if d is not None:
        _disk_metrics(out, label, d)


def _disk_metrics(out: _Families, label: str, d: dict) -> None:
    out.add("kvtier_l3_used_bytes", label, d["used_bytes"])
    out.add("kvtier_l3_free_bytes", label, max(0, d["capacity_bytes"] - d["used_bytes"]))
    out.add("kvtier_l3_capacity_bytes", label, d["capacity_bytes"])
    out.add("kvtier_l3_file_bytes", label, d["disk_bytes"])
    out.add("kvtier_l3_records", label, d["records"])
    out.add("kvtier_l3_written_bytes", label,
            d["bytes_written"] + d["compact_bytes_written"] + d["checkpoint_bytes_written"])
    out.add("kvtier_l3_evictions", label, d["evictions"])
    out.add("kvtier_l3_evicted_bytes", label, d["evicted_bytes"])
    out.add("kvtier_l3_offered", label, d["offered"])
    out.add("kvtier_l3_admission_refusals", label, d["admission_refused"])
    out.add("kvtier_l3_compactions", label, d["compactions"])
    out.add("kvtier_l3_crc_failures", label, d["corrupt"], phase="read")
    out.add("kvtier_l3_crc_failures", label, d["scan_corrupt"], phase="scan")
    out.add("kvtier_l3_disk_full_errors", label, d["disk_full_errors"])


def _open_stores() -> list:
    from kvtier.hf.registry import open_stores

    return open_stores()


class KVTierCollector(Collector):
    """The metrics of kvtier stores, read from their ``stats()`` at each scrape.

    Args:
        stores: the stores to report (``cache.store``); None: every store the process's caches
            hold at the time of the scrape (``kvtier.hf.registry.open_stores``).
    """

    def __init__(self, stores: Iterable | None = None) -> None:
        self._stores: Callable[[], list] = _open_stores if stores is None else (lambda s=list(stores): s)

    def collect(self) -> Iterator[Metric]:
        out = _Families()
        seen: dict[str, int] = {}
        for store in self._stores():
            if store.closed:
                continue
            label = store_label(store)
            seen[label] = n = seen.get(label, 0) + 1
            if n > 1:  # two stores of one identity without L3 (built by hand): keep their series apart
                label = f"{label}#{n}"
            try:
                _store_metrics(out, store, label)
            except Exception:
                if not store.closed:
                    raise
                # closed while being read: it has nothing more to report
        yield from out


class MetricsServer:
    """The HTTP endpoint :func:`serve` started; :meth:`close` stops it."""

    def __init__(self, httpd, thread, registry: CollectorRegistry) -> None:
        self._httpd, self._thread = httpd, thread
        self.registry = registry
        self.address, self.port = httpd.server_address[:2]

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve(port: int, addr: str = "127.0.0.1", stores: Iterable | None = None) -> MetricsServer:
    """Serve the stores' metrics at ``http://addr:port/metrics`` from a daemon thread.

    Args:
        port: TCP port; 0 picks a free one (``server.port`` says which).
        addr: address to listen on; loopback by default (the metrics name model identities and
            directories: expose them wider on purpose, e.g. ``"0.0.0.0"``).
        stores: as :class:`KVTierCollector` (None: every store the process opens).
    Returns:
        The running :class:`MetricsServer`.
    """
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in 0..65535 (0: any free port); got {port!r}")
    registry = CollectorRegistry()
    registry.register(KVTierCollector(stores))
    httpd, thread = start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(httpd, thread, registry)
