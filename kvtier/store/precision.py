"""Precision that follows importance: which codec an evicted block is stored in, and when a
recalled low-precision block is read from its higher-precision copy instead.

Every observation (``KVStore.observe``: h2o/snapkv statistics) gives each observed block its
mass relative to the observation's mean mass per block (1.0: an even share); a block's
statistic is the mean of those over the observations it had, so that old blocks, observed
more often and when the context was shorter, do not outrank new ones by age alone. At eviction
it is ranked among the sealed blocks of its (sequence, layer)::

    mid-rank r = (blocks below it + half the blocks tied with it) / observed sealed blocks
      r >= 1 - heavy_fraction   -> heavy_codec   (e.g. int8)
      r <  cold_fraction        -> cold_codec    (e.g. int2)
      otherwise                 -> codec         (e.g. int4)

Ties share their mid-rank. A block evicted before any observation saw it (a prefill chunk
longer than L1 evicts some of its own blocks before its attention runs) has no evidence either
way and is stored in ``codec``; it does not enter the ranking of the others either.

A block stored in fewer bits than ``codec`` is *below base*: the swap-out worker also writes
its ``codec`` record to L3 (when there is an L3, no copy there yet, and a recall can fire:
``recall_mass`` finite), the backup; a store that never upgrades keeps none, so its L3 holds
no bytes that no read can use. When one
observation gives it ``recall_mass`` times the observation's reference mass, its record is
marked for upgrade; the next read below L1 decodes the L3 backup and, once that decoded, drops
the low L2 copy (as a spill would): from then on the backup is the block's copy below L1. A
backup that cannot be read clears the mark and the low copy stays. A block marked while L1
holds a decode of its low copy (it was recalled into L1, which is how it came to be observed)
gets the backup at its next read too: that read frees the L1 copy (clean: nothing to write) and
swaps the block in again, from the backup. An L1 copy that is the block as written (never below
L1) is kept; the mark applies when it next comes back from below.

The reference (``recall_reference``) is taken over the observation's *candidates*: the
observed blocks outside the sink blocks, the recent window and the open block. Those are never
stored below L1 while protected and take most of each observation's mass (the sink alone much
of it), so a mean over every block sits above nearly every candidate's share, and no recall
reached ``recall_mass`` times it in measured runs::

    median    the candidates' median mass (half of them are above it)
    mean      the candidates' mean mass
    all-mean  the mean over every observed block, sink, window and open block included
"""
from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass

from kvtier.config import PRECISION_CODECS, KVTierConfig

_BITS = {c: int(c[3:]) for c in PRECISION_CODECS}


@dataclass(frozen=True)
class PrecisionPlan:
    heavy: str
    base: str
    cold: str
    heavy_fraction: float
    cold_fraction: float
    recall_mass: float
    recall_reference: str = "median"

    @classmethod
    def of(cls, cfg: KVTierConfig) -> "PrecisionPlan | None":
        """The plan of ``cfg`` (checked by the config), or None for ``precision="fixed"``."""
        if cfg.precision != "importance":
            return None
        return cls(cfg.heavy_codec, cfg.codec, cfg.cold_codec, float(cfg.heavy_fraction),
                   float(cfg.cold_fraction), float(cfg.recall_mass), cfg.recall_reference)

    @property
    def codecs(self) -> tuple[str, ...]:
        """The distinct codecs a record of this store may carry, base first."""
        return tuple(dict.fromkeys((self.base, self.heavy, self.cold)))

    def below_base(self, codec: str) -> bool:
        return _BITS[codec] < _BITS[self.base]

    @property
    def recalls(self) -> bool:
        """Whether a block below base can ever be upgraded (and so needs its backup)."""
        return not math.isinf(self.recall_mass)

    @staticmethod
    def statistic(e) -> float:
        """An observed block's mean share of the attention mass per observation."""
        return e.rel_mass / e.seen

    def ranking(self, entries) -> list[float]:
        """The sorted statistics of the observed ones of ``entries`` (a table's sealed blocks)."""
        return sorted(self.statistic(e) for e in entries if e.seen)

    def choose(self, ranking: list[float], value: float) -> str:
        """The codec of a block whose statistic is ``value`` among ``ranking`` (sorted)."""
        n = len(ranking)
        if n == 0:
            return self.base
        lo = bisect.bisect_left(ranking, value)
        hi = bisect.bisect_right(ranking, value)
        r = (lo + hi) / 2 / n
        if r >= 1.0 - self.heavy_fraction and self.heavy_fraction > 0:
            return self.heavy
        if r < self.cold_fraction:
            return self.cold
        return self.base

    def recall_threshold(self, candidates: list[float], observed: list[float]) -> float | None:
        """The mass at which a block below base is marked for upgrade in one observation, from
        the masses of its ``candidates`` (observed blocks outside sink, window and open block)
        and of every ``observed`` block; None when no block can be marked (nothing to compare
        with, or ``recall_mass`` infinite)."""
        if math.isinf(self.recall_mass):
            return None
        pool = observed if self.recall_reference == "all-mean" else candidates
        if not pool:
            return None
        ref = statistics.median(pool) if self.recall_reference == "median" else sum(pool) / len(pool)
        return self.recall_mass * ref if ref > 0 else None
