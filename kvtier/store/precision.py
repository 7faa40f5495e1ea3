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
its ``codec`` record to L3 (when there is an L3 and no copy there yet), the backup. When one
observation gives it ``recall_mass`` times the observation's mean mass per block, its record
is marked for upgrade; the next read below L1 drops the low L2 copy (as a spill would) and
decodes the L3 one, which from then on is the block's copy below L1.
"""
from __future__ import annotations

import bisect
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

    @classmethod
    def of(cls, cfg: KVTierConfig) -> "PrecisionPlan | None":
        """The plan of ``cfg`` (checked by the config), or None for ``precision="fixed"``."""
        if cfg.precision != "importance":
            return None
        return cls(cfg.heavy_codec, cfg.codec, cfg.cold_codec, float(cfg.heavy_fraction),
                   float(cfg.cold_fraction), float(cfg.recall_mass))

    @property
    def codecs(self) -> tuple[str, ...]:
        """The distinct codecs a record of this store may carry, base first."""
        return tuple(dict.fromkeys((self.base, self.heavy, self.cold)))

    def below_base(self, codec: str) -> bool:
        return _BITS[codec] < _BITS[self.base]

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

    def recalled_heavy(self, x: float, mean: float) -> bool:
        """Whether one observation's mass ``x`` of a block (``mean`` per block) marks it for upgrade."""
        return mean > 0 and x >= self.recall_mass * mean
