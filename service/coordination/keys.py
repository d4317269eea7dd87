"""Every Redis key and channel name the service uses, built in this one module.

All names start with a prefix (``STEPTALLY_REDIS_PREFIX``, default ``steptally``), so
several deployments, or tests, can share one Redis without seeing each other:

    {prefix}:events:finalised    pub/sub channel: every replica's "step finalised" events
    {prefix}:deadlines           sorted set: open steps ``{run_id}:{step}`` by deadline
    {prefix}:deadlines:built     string: present once the schedule holds every open step
    {prefix}:fence               counter: the fencing tokens of claims
    {prefix}:claim:{run_id}:{step}   string with a lease: the replica finalising that step
    {prefix}:progress:{{run}:{step}}:ranks     bitmap: bit ``rank`` set once it committed
    {prefix}:progress:{{run}:{step}}:declared  bitfield: the fragments each rank
                                               declared, ``i64`` at ``#rank``

A progress key names its run as ``{run_id}.{created_us}`` (the run's id and its
registration time in microseconds), so a database recreated under a Redis that still
holds an earlier one's keys never reads them. The inner braces of the progress keys
are a Redis Cluster hash tag: a step's two keys live on one shard.

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

    @property
    def deadlines(self) -> str:
        """The sorted set of open steps by deadline (:mod:`.schedule`)."""
        return f"{self.prefix}:deadlines"

    @property
    def deadlines_built(self) -> str:
        """Set once the schedule holds every open step; missing after a wipe."""
        return f"{self.prefix}:deadlines:built"

    @property
    def fence(self) -> str:
        """The counter that numbers claims."""
        return f"{self.prefix}:fence"

    def claim(self, member: str) -> str:
        """The claim on one step (``member`` is ``{run_id}:{step}``)."""
        return f"{self.prefix}:claim:{member}"

    def progress_ranks(self, run: str, step: int) -> str:
        """The bitmap of the ranks that committed an open step (:mod:`.progress`);
        ``run`` is ``{run_id}.{created_us}``."""
        return f"{self.prefix}:progress:{{{run}:{step}}}:ranks"

    def progress_declared(self, run: str, step: int) -> str:
        """The fragments each committed rank of an open step declared (:mod:`.progress`)."""
        return f"{self.prefix}:progress:{{{run}:{step}}}:declared"
