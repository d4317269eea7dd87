"""The deadline schedule of open steps, shared by every replica through Redis.

With ``STEPTALLY_REDIS_URL`` set, each replica adds the steps a batch opens to one
sorted set (member ``{run_id}:{step}``, score the step's deadline), and timing out
steps reads only the due members of that set: O(due steps), whatever the number of
open steps or replicas. A due step is *claimed* before it is finalised (``SET NX`` with
a lease, the value a fencing token from one counter), so two replicas' sweepers do
not both lock the same rows; the database write stays the fence: it finalises a step
only under its row lock, only while the row is still open and due, so a claim whose
holder stalled past its lease can never finalise a revision twice.

PostgreSQL stays the source of truth. Nothing here is the only copy of anything:

* the schedule is marked *built* by one key. A Redis wiped (or restarted without its
  data) has no such key; the next sweep finds it missing and rebuilds the schedule
  from the database's open steps before it reads the due ones. A Redis restarted
  *with* its append-only file may still have lost its last writes (``appendfsync
  everysec``): every sweep reads the server's ``run_id``, and a new one rebuilds too;
* a member whose step is no longer open (finalised by a completing batch, or by
  another replica) is removed when it comes due;
* Redis unreachable: the sweeper falls back to the database's own index of open
  steps by deadline, and ingest does not wait on Redis (see
  :class:`~steptally.service.coordination.store.CoordinatedStore`).

The synchronous redis-py client is used on purpose: every caller runs in the thread
pool beside the store's database work, never on the event loop.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import redis

from steptally.service.coordination.keys import RedisKeys

CONNECT_TIMEOUT_S = 1.0
SOCKET_TIMEOUT_S = 1.0
CLAIM_LEASE_MS = 30_000  # a claim outlives any one finalisation by far
REBUILD_CHUNK = 1000

# Release a claim only if it is still ours (its value is our token).
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


@dataclass(frozen=True, slots=True)
class Due:
    """An open step whose deadline has passed, as the schedule knows it."""

    run_id: int
    step: int
    deadline: float

    @property
    def member(self) -> str:
        return member(self.run_id, self.step)


def member(run_id: int, step: int) -> str:
    return f"{run_id}:{step}"


def parse_member(raw: bytes | str) -> tuple[int, int]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    run_id, step = text.split(":", 1)
    return int(run_id), int(step)


class DeadlineSchedule:
    """One sorted set of open steps by deadline, their claims and the built marker."""

    def __init__(self, client: redis.Redis, keys: RedisKeys) -> None:
        self._redis = client
        self._keys = keys
        self._release = client.register_script(_RELEASE)
        self.replica = uuid.uuid4().hex  # who holds a claim, for a person reading Redis

    @classmethod
    def from_url(cls, url: str, keys: RedisKeys) -> DeadlineSchedule:
        client = redis.Redis.from_url(
            url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=SOCKET_TIMEOUT_S
        )
        return cls(client, keys)

    def close(self) -> None:
        self._redis.close()

    def add(self, steps: Iterable[tuple[int, int, float]]) -> None:
        """Schedule ``(run_id, step, deadline)``; a step already scheduled keeps the
        earlier deadline (the first arrival's, as the database has it)."""
        mapping = {member(run_id, step): deadline for run_id, step, deadline in steps}
        if mapping:
            self._redis.zadd(self._keys.deadlines, mapping, nx=True)

    @property
    def client(self) -> redis.Redis:
        """The client, for others' keys in the same round trips (:mod:`.progress`)."""
        return self._redis

    @property
    def keys(self) -> RedisKeys:
        return self._keys

    def pipeline(self) -> redis.client.Pipeline:
        return self._redis.pipeline(transaction=False)

    def update(
        self, add: Sequence[tuple[int, int, float]], remove: Sequence[tuple[int, int]]
    ) -> None:
        """:meth:`add` and :meth:`remove` in one round trip."""
        if not add and not remove:
            return
        pipe = self.pipeline()
        self.queue_update(pipe, add, remove)
        pipe.execute()

    def queue_update(
        self,
        pipe: redis.client.Pipeline,
        add: Sequence[tuple[int, int, float]],
        remove: Sequence[tuple[int, int]],
    ) -> None:
        """Queue :meth:`update` on ``pipe``."""
        if add:
            pipe.zadd(self._keys.deadlines, {member(r, s): d for r, s, d in add}, nx=True)
        if remove:
            pipe.zrem(self._keys.deadlines, *(member(r, s) for r, s in remove))

    def reschedule(self, run_id: int, step: int, deadline: float) -> None:
        """Set a step's deadline to what the database says it is."""
        self._redis.zadd(self._keys.deadlines, {member(run_id, step): deadline})

    def remove(self, steps: Iterable[tuple[int, int]]) -> None:
        members = [member(run_id, step) for run_id, step in steps]
        if members:
            self._redis.zrem(self._keys.deadlines, *members)

    def due(self, now: float, limit: int) -> list[Due]:
        """The steps due at ``now``, earliest first, at most ``limit``."""
        rows = cast(
            "list[tuple[bytes, float]]",
            self._redis.zrangebyscore(
                self._keys.deadlines, "-inf", now, start=0, num=limit, withscores=True
            ),
        )
        return [Due(*parse_member(raw), float(score)) for raw, score in rows]

    def claim(self, due: Due) -> str | None:
        """A fencing token if this replica now holds ``due``'s claim, else None."""
        token = f"{self._redis.incr(self._keys.fence)}:{self.replica}"
        taken = self._redis.set(self._keys.claim(due.member), token, nx=True, px=CLAIM_LEASE_MS)
        return token if taken else None

    def release(self, due: Due, token: str) -> None:
        self._release(keys=[self._keys.claim(due.member)], args=[token])

    def is_built(self) -> bool:
        return bool(self._redis.exists(self._keys.deadlines_built))

    def rebuild(self, open_steps: Iterable[tuple[int, int, float]]) -> int:
        """Schedule every open step the database holds, then mark the schedule built.

        Members are added with ``NX``: a step an ingest scheduled meanwhile keeps its
        deadline, and a rebuild racing another replica's adds the same members."""
        count = 0
        chunk: list[tuple[int, int, float]] = []
        for row in open_steps:
            chunk.append(row)
            if len(chunk) == REBUILD_CHUNK:
                self.add(chunk)
                count += len(chunk)
                chunk = []
        self.add(chunk)
        count += len(chunk)
        self._redis.set(self._keys.deadlines_built, self.replica)
        return count

    def server_id(self) -> str:
        """The Redis server's ``run_id``: new at every start of the server."""
        info = self._redis.info("server")
        return str(info["run_id"])

    def ping(self) -> None:
        self._redis.ping()
