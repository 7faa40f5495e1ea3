"""kvtier's counters in vLLM's metrics: the ``KVConnectorStats`` the worker hands vLLM after each
step and the ``KVConnectorPromMetrics`` that turn them into series of vLLM's Prometheus registry
(``vllm serve``'s ``/metrics``; ``LLM.get_metrics()`` offline). The names and payload are in
``counters.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from .counters import CONNECTOR_METRICS, merge, split_key


@dataclass
class KVTierConnectorStats(KVConnectorStats):
    """``data`` is a payload of ``counters.py``: counter growth and gauge values."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}}

    def aggregate(self, other: KVConnectorStats) -> "KVTierConnectorStats":
        self.data = merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        # the stats logger's line: "KV Transfer metrics: kvtier_loaded_blocks=4, ..."
        out = {}
        for kind in ("counters", "gauges"):
            for key, v in self.data.get(kind, {}).items():
                name, tier = split_key(key)
                out[name.removeprefix("vllm:") + (f"_{tier}" if tier else "")] = v
        return out

    def is_empty(self) -> bool:
        return not self.data.get("counters") and not self.data.get("gauges")


class KVTierPromMetrics(KVConnectorPromMetrics):
    """One vLLM metric per :data:`CONNECTOR_METRICS` entry, with vLLM's labels (+ ``tier``)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._series: dict[str, dict[int, Any]] = {}  # payload key -> engine -> labelled child
        for name, (kind, tiers, doc) in CONNECTOR_METRICS.items():
            cls = self._counter_cls if kind == "counter" else self._gauge_cls
            metric = cls(name=name, documentation=f"kvtier: {doc}",
                         labelnames=[*labelnames, "tier"] if tiers else list(labelnames))
            for tier in tiers or (None,):
                self._series[name if tier is None else f"{name}/{tier}"] = {
                    idx: metric.labels(*values, *([tier] if tier else []))
                    for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, n in transfer_stats_data.get("counters", {}).items():
            if (s := self._series.get(key)) is not None:
                s[engine_idx].inc(n)
        for key, v in transfer_stats_data.get("gauges", {}).items():
            if (s := self._series.get(key)) is not None:
                s[engine_idx].set(v)
