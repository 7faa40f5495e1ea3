"""Counters and latency samples of a store; percentiles are computed only when asked."""
from __future__ import annotations

import threading
from collections import deque

_SAMPLES = 2048  # recent samples the percentiles are taken over


class Latency:
    """Recent latency samples in seconds (bounded), reported in milliseconds."""

    __slots__ = ("samples", "count", "total")

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=_SAMPLES)
        self.count = 0
        self.total = 0.0

    def add(self, seconds: float, n: int = 1) -> None:
        """``n`` samples of ``seconds`` each (a batch of n reads timed together, per read)."""
        self.samples.extend((seconds,) * n)
        self.count += n
        self.total += seconds * n

    def summary(self) -> dict:
        s = sorted(self.samples)
        return {
            "count": self.count,
            "mean_ms": (self.total / self.count * 1e3) if self.count else 0.0,
            "p50_ms": _pct(s, 0.50) * 1e3,
            "p99_ms": _pct(s, 0.99) * 1e3,
            # every sample ever taken (not only the recent ones the percentiles see)
            "total_s": self.total,
        }


def _pct(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    # nearest-rank percentile
    i = min(len(sorted_vals) - 1, max(0, int(round(q * len(sorted_vals) + 0.5)) - 1))
    return sorted_vals[i]


def ratio(num: float, den: float) -> float | None:
    return (num / den) if den else None


#: Event counters of a store (``stats()`` groups them). Copies and bytes held below L1 and the
#: blocks per home tier are state, kept by the residency part, not counted here.
COUNTERS = (
    "hits_l1", "misses_l1", "hits_l2", "misses_l2", "hits_l3", "misses_l3", "hits_l4", "misses_l4",
    "swap_in_l2_bytes", "swap_in_l3_bytes", "swap_in_l4_bytes", "swap_out_l2_bytes",
    "swap_out_l3_bytes", "swap_in_blocks", "swap_out_blocks", "evicted_clean", "evicted_dirty",
    "evict_failed", "swap_out_failed", "sync_evictions", "scratch_uses", "pf_issued", "pf_errors", "pf_used",
    "pf_wasted", "raw_l2", "enc_l2", "raw_l3", "enc_l3", "stage_in", "stage_out",
    "pub_encode_failed", "pub_l3_blocks", "pub_l3_bytes", "pub_l3_failed", "pub_l4_blocks", "pub_l4_bytes",
    "pub_l4_failed", "orphans_deleted", "prefix_lookups", "prefix_lookup_tokens",
    "prefix_hit_tokens", "prefill_tokens_saved", "dedup_seals", "adopted_l3", "gather_views",
    "gather_copies", "region_moves", "l3_disk_full", "l1_growths",
    "precision_int8", "precision_int4", "precision_int2", "precision_backups",
    "precision_backup_failed", "precision_upgrades", "precision_marked", "precision_upgrade_bytes",
    "precision_upgrade_failed", "precision_refetched", "pub_l3_not_admitted",
    # stored blocks refused because their identity did not match the reader's (a miss, never data)
    "identity_refusals",
)


class Counters:
    """The event counters and latency samples of one store, under their own lock.

    The lock is a leaf: nothing else is taken while it is held, so any part may count from any
    thread, holding whatever lock it holds.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = dict.fromkeys(COUNTERS, 0)
        # step_swapped / step_unswapped: the same steps as ``step``, split by whether a block was
        # swapped in since the previous step (the TPOT jitter swaps cause, seen apart)
        self._lat = {"swap_in": Latency(), "swap_out": Latency(), "step": Latency(),
                     "step_swapped": Latency(), "step_unswapped": Latency()}

    def add(self, **deltas: int) -> None:
        with self._lock:
            n = self._n
            for name, d in deltas.items():
                n[name] += d

    def sample(self, latency: str, seconds: float, n: int = 1) -> None:
        """``n`` samples of ``latency`` (swap_in, swap_out, step, step_swapped or step_unswapped),
        ``seconds`` each."""
        with self._lock:
            self._lat[latency].add(seconds, n)

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._n[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._n)

    def latency_summaries(self) -> dict[str, dict]:
        with self._lock:
            return {name: lat.summary() for name, lat in self._lat.items()}
