"""Open steps' commit progress in Redis: which ranks committed, and how many fragments
each declared, so reading an open step need not query its commits.

Per open step two small strings (:class:`~.keys.RedisKeys`): a bitmap with bit
``rank`` set once that rank committed (512 bytes at 4096 ranks), and a bitfield of
the fragments each rank declared (``i64`` at ``#rank``; 32 KB at 4096 ranks). The
fragments expected are the sum of the declared counts; the fragments that arrived,
per rank, come with the fragments a read evaluates anyway.

Every write is a fact the database already holds: ingest records a batch's commits
only after its transaction committed, and a commit never changes. Writes are
idempotent (a bit set twice, a count written twice) and commute, so retries,
replicas racing each other and a rebuild racing ingest all leave the same state;
there are no counters to double-count. A write may still be missing (Redis wiped or
restarted, a replica killed between its commit and its write): a reader uses what
Redis holds only when it agrees with the step row's own counters, read *after*
Redis. What Redis holds then is a subset of the database's commits of the same size,
so it is all of them; any other answer is ignored and the database read instead.

Nothing here decides anything: finalisation reads the database under the row lock.
A step's keys are deleted when it is finalised, and expire an hour after its
deadline whatever happens (:data:`GRACE_S`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from itertools import groupby
from typing import NamedTuple

import redis

from steptally.service.coordination.keys import RedisKeys

GRACE_S = 3600  # a step's keys outlive its deadline by this much
REBUILD_CHUNK = 1000  # commits per round trip of a rebuild

Commits = dict[int, int]  # rank -> fragments declared


def run_key(run_id: int, created_at: float) -> str:
    """How progress keys name a run: its id and registration time, which tell two
    databases' runs of one id apart (:class:`~.keys.RedisKeys`)."""
    return f"{run_id}.{round(created_at * 1_000_000)}"


class OpenCommit(NamedTuple):
    """A commit of an open step as the database holds it (``run``: :func:`run_key`)."""

    run: str
    step: int
    rank: int
    declared: int
    deadline: float


def decode(ranks: bytes | None, declared: bytes | None) -> Commits:
    """The commits a step's two keys hold (rank -> fragments declared)."""
    out: Commits = {}
    declared = declared or b""
    for i, byte in enumerate(ranks or b""):
        if not byte:
            continue
        for bit in range(8):
            if byte & (0x80 >> bit):  # Redis numbers the bits of a byte from the top
                rank = 8 * i + bit
                raw = declared[8 * rank : 8 * rank + 8]
                out[rank] = int.from_bytes(raw, "big", signed=True) if len(raw) == 8 else 0
    return out


def agrees(commits: Commits, counters: tuple[int, int] | None) -> bool:
    """Whether ``commits`` are as many, declaring as many fragments, as the step row's
    ``(ranks committed, fragments expected)``."""
    return counters is not None and (len(commits), sum(commits.values())) == counters


class ProgressBoard:
    """Writes and reads of the progress keys, queued on a caller's pipeline or alone."""

    def __init__(self, client: redis.Redis, keys: RedisKeys) -> None:
        self._redis = client
        self._keys = keys

    def record(
        self,
        pipe: redis.client.Pipeline,
        run: str,
        commits: Mapping[int, Mapping[int, int]],
        ttl_s: float,
    ) -> None:
        """Queue ``commits`` (step -> rank -> fragments declared), each step's keys kept
        ``ttl_s`` from now. The count is written before the bit, so a reader that sees a
        rank's bit sees its count."""
        ttl = max(1, math.ceil(ttl_s))
        for step, ranks in commits.items():
            if not ranks:
                continue
            declared_key = self._keys.progress_declared(run, step)
            ranks_key = self._keys.progress_ranks(run, step)
            declared = pipe.bitfield(declared_key)
            bits = pipe.bitfield(ranks_key)
            for rank, n in ranks.items():
                declared.set("i64", f"#{rank}", n)
                bits.set("u1", rank, 1)
            declared.execute()  # queued on the pipeline
            bits.execute()
            pipe.expire(declared_key, ttl)
            pipe.expire(ranks_key, ttl)

    def forget(self, pipe: redis.client.Pipeline, run: str, steps: Iterable[int]) -> None:
        """Queue the deletion of finalised steps' keys."""
        keys = [
            key
            for step in steps
            for key in (
                self._keys.progress_ranks(run, step),
                self._keys.progress_declared(run, step),
            )
        ]
        if keys:
            pipe.delete(*keys)

    def read(self, run: str, steps: Sequence[int]) -> dict[int, Commits]:
        """What Redis holds of each step's commits, in one round trip (empty when none)."""
        if not steps:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        for step in steps:
            pipe.get(self._keys.progress_ranks(run, step))
            pipe.get(self._keys.progress_declared(run, step))
        raw = pipe.execute()
        return {step: decode(raw[2 * i], raw[2 * i + 1]) for i, step in enumerate(steps)}

    def rebuild(self, open_commits: Iterable[OpenCommit], now: float) -> int:
        """Record every commit of the database's open steps, in step order; returns how
        many. Safe beside ingest: it writes the same facts."""
        count = queued = 0
        pipe = self._redis.pipeline(transaction=False)
        for (run, step), rows in groupby(open_commits, key=lambda c: (c.run, c.step)):
            commits = list(rows)
            ranks = {c.rank: c.declared for c in commits}
            self.record(pipe, run, {step: ranks}, commits[0].deadline - now + GRACE_S)
            count += len(ranks)
            queued += len(ranks)
            if queued >= REBUILD_CHUNK:
                pipe.execute()
                queued = 0
        if queued:
            pipe.execute()
        return count
