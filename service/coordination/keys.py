"""Every Redis key and channel name the service uses, built in this one module.

All names start with a prefix (``STEPTALLY_REDIS_PREFIX``, default ``steptally``), so
several deployments, or tests, can share one Redis without seeing each other:

    {prefix}:events:finalised    pub/sub channel: every replica's "step finalised" events

Nothing under the prefix is the only copy of anything: PostgreSQL stays the source of
truth, and wiping Redis loses no data.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "steptally"


@dataclass(frozen=True, slots=True)
class RedisKeys:
    """The names under one prefix."""

    prefix: str = DEFAULT_PREFIX

    @property
    def finalised_events(self) -> str:
        """The channel on which each replica publishes the steps it finalised."""
        return f"{self.prefix}:events:finalised"
