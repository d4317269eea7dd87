"""What ``create_app`` builds from the settings: the token store and the rate limiter."""

from __future__ import annotations

from steptally.service.auth.ratelimit import RateLimiter
from steptally.service.auth.tokens import TokenStore
from steptally.service.settings import Settings, database_limits
from steptally.service.store.engine import make_engine


def open_tokens(settings: Settings) -> TokenStore | None:
    """The token store when auth is on (its own engine over the service's database)."""
    if not settings.auth:
        return None
    return TokenStore(make_engine(settings.database_url, database_limits(settings)))


def limiter_of(settings: Settings) -> RateLimiter | None:
    if settings.rate_limit_per_s <= 0:
        return None
    return RateLimiter(settings.rate_limit_per_s, settings.rate_limit_burst)
