"""When to try again: capped exponential backoff with jitter, and ``Retry-After``.

Only failures that may pass are retried: a connection error or timeout, a 5xx, a 408
and a 429. Every other answer is final. A batch carries the idempotency keys
``(step, rank, seq)`` of its fragments, so sending it twice never counts it twice.
"""

from __future__ import annotations

import email.utils
import random
import time
from collections.abc import Callable

RETRYABLE_STATUS = frozenset({408, 429})


def is_retryable(status: int) -> bool:
    return status >= 500 or status in RETRYABLE_STATUS


def parse_retry_after(value: str | None, now: Callable[[], float] = time.time) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: delay-seconds or an HTTP date."""
    if value is None:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - now())


class Backoff:
    """Delays ``base * 2**n``, capped at ``cap``, with equal jitter (half fixed, half random).

    Every delay lies in ``[d / 2, d]`` for ``d = min(cap, base * 2**n)``, so the waits
    grow quickly to the cap and never exceed it, and ranks that failed together do not
    retry in lockstep.
    """

    def __init__(self, base: float, cap: float, rng: Callable[[], float] = random.random) -> None:
        self.base = base
        self.cap = cap
        self.attempt = 0
        self._rng = rng

    def reset(self) -> None:
        self.attempt = 0

    def next(self, retry_after: float | None = None, max_retry_after: float = 300.0) -> float:
        """The next delay; a server's ``Retry-After`` wins (up to ``max_retry_after``)."""
        ceiling = min(self.cap, self.base * 2.0 ** min(self.attempt, 64))
        self.attempt += 1
        if retry_after is not None:
            return min(retry_after, max_retry_after)
        return ceiling / 2 + self._rng() * ceiling / 2
