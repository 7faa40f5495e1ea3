"""Whether a remote tier's server answers, as the L4 tiers (Redis, Mooncake) both track it: when it
went away, when to try it again, the warnings that say so, and round-trip latencies.

One warning per outage ("... unreachable ...") and one when it ends ("... reachable again ...");
while it lasts, :meth:`Reach.skip` tells the tier to answer with a miss at once until the retry
time, which backs off from ``retry_interval_s`` doubling up to ``max_backoff`` times it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable
from urllib.parse import SplitResult, urlsplit

import numpy as np

from .base import TierStats
from .errors import TierClosedError

WARN_EVERY_S = 10.0


def check_seconds(name: str, v: object, allow_zero: bool) -> float:
    """``v`` as a finite number of seconds (> 0, or >= 0 with ``allow_zero``); ValueError naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 if allow_zero else v > 0) \
            or v == float("inf"):
        raise ValueError(f"{name} must be a finite number {'>=' if allow_zero else '>'} 0; got {v!r}")
    return float(v)


def check_window(latency_window: object) -> int:
    if isinstance(latency_window, bool) or not isinstance(latency_window, int) or latency_window < 1:
        raise ValueError(f"latency_window must be an int >= 1; got {latency_window!r}")
    return latency_window


class Reach:
    """The reachability of one server (thread-safe; its lock guards every field below).

    Args:
        label: how warnings name the server, e.g. ``"RemoteTier redis://h:6379/0"``.
        retry_interval_s: least time from a failure to the next try; tiers may change it later.
        max_backoff: the retry interval doubles on each failed try, up to this many times
            ``retry_interval_s`` (1: a fixed interval).
        latency_window: round trips kept for the percentiles.
    """

    def __init__(self, label: str, log: logging.Logger, retry_interval_s: float, max_backoff: float = 1.0,
                 latency_window: int = 4096) -> None:
        self.label, self.log = label, log
        self.retry_interval_s = retry_interval_s
        self.max_backoff = max_backoff
        self.lock = threading.Lock()
        self.down_since: float | None = None
        self.next_try = 0.0
        self.backoff = 0.0
        self.outages = self.errors = self.skipped = 0
        self.last_warn = -1e9
        self.latency_s: deque[float] = deque(maxlen=latency_window)

    @property
    def connected(self) -> bool:
        """False while the server is known to be unreachable (True before first contact)."""
        return self.down_since is None

    def skip(self, n_keys: int) -> bool:
        """True (``n_keys`` counted as skipped) while the server is down and not due for a try."""
        with self.lock:
            if self.down_since is not None and time.monotonic() < self.next_try:
                self.skipped += n_keys
                return True
        return False

    def count_skipped(self, n_keys: int) -> None:
        with self.lock:
            self.skipped += n_keys

    def count_error(self) -> None:
        with self.lock:
            self.errors += 1

    def went_down(self, why: str) -> None:
        """A try failed: warn if this starts an outage, and set the next try."""
        now = time.monotonic()
        with self.lock:
            self.errors += 1
            first = self.down_since is None
            if first:
                self.down_since = now
                self.outages += 1
                self.backoff = self.retry_interval_s
            else:
                self.backoff = min(2 * self.backoff, self.max_backoff * self.retry_interval_s)
            self.next_try = now + self.backoff
        if first:
            self.log.warning("%s unreachable (%s): serving misses, retrying every %.1fs%s", self.label, why,
                             self.retry_interval_s, " or less often" if self.max_backoff > 1 else "")
        else:
            self.log.debug("%s still unreachable: %s", self.label, why)

    def came_up(self, round_trip_s: float | None = None) -> None:
        """A round trip succeeded (taking ``round_trip_s``, when it is to be counted)."""
        if round_trip_s is not None:
            with self.lock:
                self.latency_s.append(round_trip_s)
        if self.down_since is None:
            return
        with self.lock:
            since, self.down_since = self.down_since, None
        if since is not None:
            self.log.warning("%s reachable again after %.1fs", self.label, time.monotonic() - since)

    def warn_limited(self, msg: str, *args) -> None:
        """A warning at most every ``WARN_EVERY_S`` (a full server refuses every put of a decode loop)."""
        now = time.monotonic()
        with self.lock:
            due = now - self.last_warn >= WARN_EVERY_S
            if due:
                self.last_warn = now
        (self.log.warning if due else self.log.debug)(msg, *args)

    def stats(self) -> dict:
        """errors, skipped, outages, latency_p50_ms/latency_p99_ms per round trip, round_trips, connected."""
        with self.lock:
            lat = np.array(self.latency_s, dtype=np.float64) * 1e3
            s = dict(errors=self.errors, skipped=self.skipped, outages=self.outages)
        s.update(latency_p50_ms=float(np.percentile(lat, 50)) if lat.size else 0.0,
                 latency_p99_ms=float(np.percentile(lat, 99)) if lat.size else 0.0,
                 round_trips=int(lat.size), connected=self.connected)
        return s


def split_url(url: object, bad: Callable[[object, str], ValueError]) -> tuple[SplitResult, int | None]:
    """``url`` split, and its port: a remote tier's URL before its own checks. ``bad(url, why)``
    makes the ValueError for a non-str, empty or unparsable one."""
    if not isinstance(url, str) or not url:
        raise bad(url, "got a non-str or empty value")
    try:
        u = urlsplit(url)
        return u, u.port
    except ValueError as e:
        raise bad(url, f"unparsable ({e})") from None


class Reachable:
    """What a tier holding a :class:`Reach` in ``self._reach`` shows of it."""

    _reach: Reach

    def _start(self, label: str, shown_url: str, key_prefix: str, capacity_bytes: int | None,
               retry_interval_s: float, max_backoff: float, latency_window: int,
               logger: logging.Logger) -> None:
        """The state every L4 tier starts with, from arguments its constructor has checked:
        the server's reach (warnings name it ``label``), the key prefix and quota, the counters
        its ``_lock`` guards, and open. ``shown_url``: the URL as errors may show it."""
        self.key_prefix = key_prefix
        self._shown_url = shown_url
        self._reach = Reach(label, logger, retry_interval_s, max_backoff, latency_window)
        self._quota = capacity_bytes
        self._lock = threading.Lock()
        self._stats = TierStats()
        self._rejected = self._corrupt = 0
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError(f"{type(self).__name__}({self._shown_url!r}) is closed")

    @property
    def connected(self) -> bool:
        """False while the server is known to be unreachable (True before first contact)."""
        return self._reach.connected

    @property
    def retry_interval_s(self) -> float:
        """While the server is unreachable, the least time before the next try."""
        return self._reach.retry_interval_s

    @retry_interval_s.setter
    def retry_interval_s(self, v: float) -> None:
        self._reach.retry_interval_s = check_seconds("retry_interval_s", v, allow_zero=True)
