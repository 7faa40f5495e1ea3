"""docs/grafana-kvtier.json is built on the metrics kvtier exports: every query names only series
that kvtier.metrics (transformers store) or the vLLM connector emit, and every panel has one."""
from __future__ import annotations

import json
import re
from pathlib import Path

from kvtier.vllm.counters import CONNECTOR_METRICS
from kvtier.metrics import METRICS

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana-kvtier.json"
_SERIES = re.compile(r"(?<![\w:])((?:vllm:)?kvtier_[A-Za-z0-9_]*)")


def _exported() -> set[str]:
    """Every sample name the two exporters write."""
    out = set()
    for table in (METRICS, CONNECTOR_METRICS):
        for name, (kind, _, _) in table.items():
            out |= {"counter": {name + "_total"}, "gauge": {name},
                    "summary": {name, name + "_sum", name + "_count"}}[kind]
    return out


def _queries(dash: dict) -> list[tuple[str, str]]:
    out = [(v["name"], v["definition"]) for v in dash["templating"]["list"] if v["type"] == "query"]
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p.get("targets"), f"panel {p['title']!r} has no query"
        out += [(p["title"], t["expr"]) for t in p["targets"]]
    return out


def test_every_query_names_an_exported_metric():
    dash = json.loads(DASHBOARD.read_text())
    exported = _exported()
    queries = _queries(dash)
    assert len(queries) > 20
    used = set()
    for title, expr in queries:
        names = set(_SERIES.findall(expr))
        assert names, f"{title!r}: {expr!r} names no kvtier metric"
        unknown = names - exported
        assert not unknown, f"{title!r}: {sorted(unknown)} are not exported (exported: {sorted(exported)})"
        used |= names
    # the dashboard covers both exporters
    assert any(n.startswith("vllm:") for n in used) and any(n.startswith("kvtier_") for n in used)
