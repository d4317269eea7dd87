"""The token-bucket limiter: bursts, refill, Retry-After, bounded memory, and that its
defaults never throttle a healthy 4096-rank run."""

from __future__ import annotations

import pytest

from steptally.service.auth.ratelimit import RateLimiter, retry_after
from steptally.service.settings import Settings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_the_refill_rate() -> None:
    clock = Clock()
    limiter = RateLimiter(rate=2.0, burst=3, clock=clock)
    assert [limiter.take("k") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take("k") == 0.5  # one request back in half a second at 2 per second
    assert limiter.take("other") == 0.0  # every key has its own bucket
    clock.now += 0.5
    assert limiter.wait_of("k") == 0.0
    assert limiter.take("k") == 0.0
    assert limiter.take("k") == 0.5
    clock.now += 60
    assert [limiter.take("k") for _ in range(4)] == [0.0, 0.0, 0.0, 0.5]  # never above burst


def test_retry_after_is_whole_seconds_at_least_one() -> None:
    assert [retry_after(w) for w in (0.001, 0.5, 1.0, 1.01, 7.2)] == [1, 1, 1, 2, 8]


def test_memory_is_bounded_least_recently_used_first() -> None:
    clock = Clock()
    limiter = RateLimiter(rate=1.0, burst=1, clock=clock, max_keys=2)
    assert limiter.take("a") == 0.0
    assert limiter.take("b") == 0.0
    assert limiter.take("c") == 0.0  # "a" is forgotten: it starts again full
    assert limiter.take("a") == 0.0
    assert limiter.take("c") == 1.0


def test_invalid_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="positive rate"):
        RateLimiter(rate=0.0, burst=1)
    with pytest.raises(ValueError, match="burst of at least 1"):
        RateLimiter(rate=1.0, burst=0)


def test_defaults_never_throttle_a_healthy_4096_rank_run() -> None:
    """4096 ranks sharing one token, each posting a batch every 0.5 s (the reporter's
    flush_interval_s), all on one replica, for two minutes: nothing refused. The ranks
    start in step (a job's ranks begin together) and drift by up to 0.1 s per batch."""
    settings = Settings()
    clock = Clock()
    limiter = RateLimiter(settings.rate_limit_per_s, settings.rate_limit_burst, clock=clock)
    ranks, period = 4096, 0.5
    refused = 0
    start = clock.now
    for tick in range(int(120 / period)):
        for rank in range(ranks):
            clock.now = start + tick * period + (rank % 10) * 0.01
            refused += limiter.take("token:job") > 0
    assert refused == 0


def test_a_flood_from_one_key_is_held_to_the_rate() -> None:
    settings = Settings()
    clock = Clock()
    limiter = RateLimiter(settings.rate_limit_per_s, settings.rate_limit_burst, clock=clock)
    admitted = 0
    for i in range(60_000):  # 60,000 requests within one second
        clock.now = 100.0 + i / 60_000
        admitted += limiter.take("address:10.0.0.9") == 0
    assert settings.rate_limit_burst <= admitted <= settings.rate_limit_burst + 10_001
