"""Token buckets, one per key (a token's id, or a client address), in this process.

Each bucket holds at most ``burst`` requests and refills at ``rate`` per second; a
request takes one, and a request that finds the bucket empty is told how long until
one is back (the ``Retry-After`` of a 429). Buckets live in memory, per replica: with
N replicas behind a load balancer a client may reach N times the rate. At most
``max_keys`` buckets are kept; the least recently used goes first, so memory stays
bounded whatever addresses send.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from steptally.service.settings import Settings


class RateLimiter:
    """``take(key)``: 0 when the request may go on, else the seconds to wait."""

    def __init__(
        self,
        rate: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 65536,
    ) -> None:
        if not rate > 0 or burst < 1:
            raise ValueError("a rate limit needs a positive rate and a burst of at least 1")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._max_keys = max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # level, at

    def _level(self, key: str, now: float) -> float:
        level, at = self._buckets.get(key, (float(self.burst), now))
        return min(float(self.burst), level + (now - at) * self.rate)

    def wait_of(self, key: str) -> float:
        """Seconds until ``key`` may make a request (0: now), taking nothing."""
        level = self._level(key, self._clock())
        return 0.0 if level >= 1.0 else (1.0 - level) / self.rate

    def take(self, key: str) -> float:
        """Take one request from ``key``'s bucket: 0, or the seconds to wait (nothing taken)."""
        now = self._clock()
        level = self._level(key, now)
        if level < 1.0:
            self._keep(key, level, now)
            return (1.0 - level) / self.rate
        self._keep(key, level - 1.0, now)
        return 0.0

    def _keep(self, key: str, level: float, now: float) -> None:
        self._buckets[key] = (level, now)
        self._buckets.move_to_end(key)
        while len(self._buckets) > self._max_keys:
            self._buckets.popitem(last=False)


def limiter_of(settings: Settings) -> RateLimiter | None:
    """The rate limiter the settings ask for (None: ``rate_limit_per_s`` is 0 or less)."""
    if settings.rate_limit_per_s <= 0:
        return None
    return RateLimiter(settings.rate_limit_per_s, settings.rate_limit_burst)


def retry_after(wait_s: float) -> int:
    """Whole seconds for ``Retry-After``: at least 1."""
    return max(1, math.ceil(wait_s))
