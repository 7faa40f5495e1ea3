"""Counters and latency samples of a store; percentiles are computed only when asked."""
from __future__ import annotations

from collections import deque

_SAMPLES = 2048  # recent samples the percentiles are taken over


class Latency:
    """Recent latency samples in seconds (bounded), reported in milliseconds."""

    __slots__ = ("samples", "count", "total")

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=_SAMPLES)
        self.count = 0
        self.total = 0.0

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)
        self.count += 1
        self.total += seconds

    def summary(self) -> dict:
        s = sorted(self.samples)
        return {
            "count": self.count,
            "mean_ms": (self.total / self.count * 1e3) if self.count else 0.0,
            "p50_ms": _pct(s, 0.50) * 1e3,
            "p99_ms": _pct(s, 0.99) * 1e3,
        }


def _pct(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    # nearest-rank percentile
    i = min(len(sorted_vals) - 1, max(0, int(round(q * len(sorted_vals) + 0.5)) - 1))
    return sorted_vals[i]


def ratio(num: float, den: float) -> float | None:
    return (num / den) if den else None
