"""The store with Redis coordination: SQL for every byte, Redis for the open steps'
schedule and commit progress.

:class:`CoordinatedStore` is a :class:`~steptally.service.store.protocol.Store` that
delegates every write to the SQL store it wraps, and keeps beside it the shared
:class:`~steptally.service.coordination.schedule.DeadlineSchedule` and
:class:`~steptally.service.coordination.progress.ProgressBoard`:

* ``ingest`` stores the batch first, then, once its group committed, in one Redis round
  trip for the whole group (on the SQL store's writer thread, before the answers),
  schedules the steps each batch touched at ``now`` + the run's timeout — a step
  already scheduled keeps its earlier deadline — records the commits of those still
  open, and unschedules and forgets the steps the batch finalised. A failure there is
  logged and ignored: the step is in the database, and the next rebuild schedules it
  and records its commits;
* ``get_step`` and ``list_steps`` evaluate an open step with its commits from Redis
  when Redis agrees with the step row's counters (see :mod:`.progress`), so only its
  fragments are read from the database (for a page of steps, in one query); else the
  database's commits are read, as the SQL store does. A finalised step is read from
  its stored result: Redis never enters it;
* ``sweep`` takes the due members of the schedule, claims each, and finalises it
  through the SQL store's row lock; a member whose step is no longer open is
  removed (its progress with it), one whose database deadline is later is put back at
  that deadline;
* with Redis unreachable, ``sweep`` falls back to the SQL store's scan of open steps
  by deadline (an index), and ``ingest`` and the reads stop talking to Redis (they
  never wait on a Redis that is away); once a sweep reaches Redis again, it rebuilds
  the progress and the schedule from the database's open steps, and so does the first
  sweep after a wipe or a restart of Redis (a new server ``run_id``: an append-only
  file synced every second may have lost the last second of writes).

So wiping Redis loses nothing, and no step is finalised twice: the database's row
lock and status check are the fence (see :mod:`.schedule`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Protocol

from redis.client import Pipeline
from redis.exceptions import RedisError
from sqlalchemy import Engine

from steptally.service.coordination.database import open_commits, open_live, step_live
from steptally.service.coordination.progress import (
    GRACE_S,
    Commits,
    ProgressBoard,
    agrees,
    run_key,
)
from steptally.service.coordination.schedule import DeadlineSchedule
from steptally.service.domain.batch import PreparedBatch
from steptally.service.domain.progress import Progress, StepStatus
from steptally.service.domain.run import RunRecord, RunSnapshot, RunSummary
from steptally.service.store.group_commit import Pending
from steptally.service.store.protocol import (
    Answer,
    BreachRecord,
    Decide,
    FinalisedStep,
    IngestOutcome,
    SeriesRows,
    StepRecord,
    Store,
)

log = logging.getLogger(__name__)


class SchedulableStore(Store, Protocol):
    """What the schedule and the progress need of the SQL store beyond :class:`Store`."""

    engine: Engine
    after_group: Callable[[list[Pending]], None] | None

    def submit(self, run: RunRecord, batch: PreparedBatch, now: float) -> Future[IngestOutcome]:
        """Store a batch with the next group: its outcome once the group committed."""
        ...

    def submit_call(
        self,
        run: RunRecord,
        batch: PreparedBatch,
        now: float,
        loop: asyncio.AbstractEventLoop,
        answer: Answer,
    ) -> None:
        """:meth:`submit`, answered on ``loop``."""
        ...

    def finalise_due(self, run_id: int, step: int, now: float) -> FinalisedStep | None:
        """Finalise one step as partial if it is open and due at ``now``."""
        ...

    def deadline_of(self, run_id: int, step: int) -> float | None:
        """An open step's deadline; None when the step is not open (or unknown)."""
        ...

    def finalise_stranded(self, now: float) -> list[FinalisedStep]:
        """Once: the steps complete by their counters that are not finalised so."""
        ...

    def open_deadlines(self) -> Iterator[tuple[int, int, float]]:
        """Every open step as ``(run_id, step, deadline)``."""
        ...


class CoordinatedStore:
    """A SQL store plus the Redis schedule and commit progress of open steps."""

    def __init__(
        self,
        sql: SchedulableStore,
        schedule: DeadlineSchedule,
        progress: ProgressBoard | None = None,
    ) -> None:
        """``progress`` None: on the schedule's Redis client and key prefix."""
        self.sql = sql
        self.schedule = schedule
        self.progress = progress or ProgressBoard(schedule.client, schedule.keys)
        sql.after_group = self._after_group
        self._redis_ok = True
        self._server: str | None = None  # the Redis run_id the schedule was checked on

    # every Store method but ingest, sweep, the step reads and close is the SQL store's own

    def register_run(self, name: str, decide: Decide, now: float) -> tuple[RunRecord, bool]:
        return self.sql.register_run(name, decide, now)

    def get_run(self, name: str) -> RunRecord | None:
        return self.sql.get_run(name)

    def list_runs(self, after: str | None = None, limit: int | None = None) -> list[RunSummary]:
        return self.sql.list_runs(after, limit)

    def run_summary(self, name: str) -> RunSummary | None:
        return self.sql.run_summary(name)

    def get_step(self, run: RunRecord, step: int, live: bool = True) -> StepRecord | None:
        if not live or not self._redis_ok:
            return self.sql.get_step(run, step, live)
        held = self._held(run, [step])  # before the row, which it must agree with
        record = self.sql.get_step(run, step, live=False)
        if record is None or record.status is not StepStatus.OPEN:
            return record
        return self._live(run, [record], held, recount=False)[0]

    def list_steps(
        self, run: RunRecord, start: int | None, end: int | None, limit: int, live: bool = True
    ) -> list[StepRecord]:
        if not live or not self._redis_ok:
            return self.sql.list_steps(run, start, end, limit, live)
        records = self.sql.list_steps(run, start, end, limit, live=False)
        steps = [r.step for r in records if r.status is StepStatus.OPEN]
        if not steps:
            return records
        held = self._held(run, steps)  # after the rows: counters are read again below
        return self._live(run, records, held, recount=True)

    def series(
        self, run: RunRecord, col: int, start: int | None, end: int | None, points: int | None
    ) -> SeriesRows:
        return self.sql.series(run, col, start, end, points)

    def finalised_since(
        self, run: RunRecord, after: tuple[float, int], limit: int
    ) -> list[StepRecord]:
        return self.sql.finalised_since(run, after, limit)

    def newest_finalised(self, run: RunRecord) -> tuple[float, int, int] | None:
        return self.sql.newest_finalised(run)

    def breaches(
        self,
        run: RunRecord,
        start: int | None,
        end: int | None,
        rules: Sequence[str] | None,
        after: tuple[int, str] | None,
        limit: int,
    ) -> list[BreachRecord]:
        return self.sql.breaches(run, start, end, rules, after, limit)

    def exposition_snapshot(self) -> list[RunSnapshot]:
        return self.sql.exposition_snapshot()

    def check_ready(self) -> None:
        self.sql.check_ready()

    def ingest(self, run: RunRecord, batch: PreparedBatch, now: float) -> IngestOutcome:
        return self.submit(run, batch, now).result()

    def submit(self, run: RunRecord, batch: PreparedBatch, now: float) -> Future[IngestOutcome]:
        return self.sql.submit(run, batch, now)

    def submit_call(
        self,
        run: RunRecord,
        batch: PreparedBatch,
        now: float,
        loop: asyncio.AbstractEventLoop,
        answer: Answer,
    ) -> None:
        self.sql.submit_call(run, batch, now, loop, answer)

    def _after_group(self, group: list[Pending]) -> None:
        """On the SQL store's writer thread, once a group committed: schedule the steps
        its batches touched, record their commits and forget the steps they finalised,
        in one Redis round trip for the group."""
        if not self._redis_ok:
            return  # never wait on a Redis that is away; the rebuild catches up
        try:
            pipe = self.schedule.pipeline()
            for p in group:
                if p.outcome is not None:
                    self._queue_batch(pipe, p.run, p.batch, p.now, p.outcome)
            pipe.execute()
        except (RedisError, OSError) as exc:
            self._lost(exc)

    def _queue_batch(
        self, pipe: Pipeline, run: RunRecord, batch: PreparedBatch, now: float, done: IngestOutcome
    ) -> None:
        finalised = {f.step for f in done.finalised if f.run == run.name}
        deadline = now + run.step_timeout_s
        commits: dict[int, dict[int, int]] = {}
        for (step, rank), declared in batch.commits.items():
            if step not in finalised:
                commits.setdefault(step, {})[rank] = declared
        self.schedule.queue_update(
            pipe,
            add=[(run.id, s, deadline) for s in batch.steps() if s not in finalised],
            remove=[(run.id, s) for s in finalised],
        )
        key = run_key(run.id, run.created_at)
        self.progress.record(pipe, key, commits, run.step_timeout_s + GRACE_S)
        self.progress.forget(pipe, key, finalised)

    def sweep(self, now: float, limit: int = 100) -> list[FinalisedStep]:
        try:
            server = self.schedule.server_id()
            restarted, self._server = server != self._server, server
            if restarted or not self._redis_ok or not self.schedule.is_built():
                # after a wipe, or steps opened while Redis was away: schedule them all.
                # Ingest talks to Redis again *before* the database is read, so a step
                # committed meanwhile is either in that read or scheduled by its ingest
                recovering, self._redis_ok = not self._redis_ok, True
                self.progress.rebuild(open_commits(self.sql.engine), now)
                count = self.schedule.rebuild(self.sql.open_deadlines())  # marks it built
                if recovering:
                    log.info("Redis answers again; %d open steps scheduled", count)
            due = self.schedule.due(now, limit)
        except (RedisError, OSError) as exc:
            self._lost(exc)
            return self.sql.sweep(now, limit)
        out: list[FinalisedStep] = self.sql.finalise_stranded(now)
        for item in due:
            try:
                token = self.schedule.claim(item)
            except (RedisError, OSError) as exc:
                self._lost(exc)
                break
            if token is None:
                continue  # another replica is finalising it
            try:
                done = self.sql.finalise_due(item.run_id, item.step, now)
                if done is not None:
                    out.append(done)
                    self._forget(item.run_id, item.step, done.run_record)
                    continue
                deadline = self.sql.deadline_of(item.run_id, item.step)
                if deadline is None:  # finalised by a batch, whose ingest forgot it
                    self.schedule.remove([(item.run_id, item.step)])
                else:
                    self.schedule.reschedule(item.run_id, item.step, deadline)
            except (RedisError, OSError) as exc:
                self._lost(exc)
            finally:
                with contextlib.suppress(RedisError, OSError):  # else its lease ends it
                    self.schedule.release(item, token)
        return out

    def close(self) -> None:
        self.schedule.close()
        self.sql.close()

    def _forget(self, run_id: int, step: int, run: RunRecord | None) -> None:
        """Unschedule a step just finalised and delete its progress."""
        pipe = self.schedule.pipeline()
        self.schedule.queue_update(pipe, add=(), remove=[(run_id, step)])
        if run is not None:
            self.progress.forget(pipe, run_key(run.id, run.created_at), [step])
        pipe.execute()

    def _held(self, run: RunRecord, steps: Sequence[int]) -> dict[int, Commits]:
        """What Redis holds of ``steps``' commits; empty when Redis fails."""
        try:
            return self.progress.read(run_key(run.id, run.created_at), steps)
        except (RedisError, OSError) as exc:
            self._lost(exc)
            return {}

    def _live(
        self, run: RunRecord, records: list[StepRecord], held: dict[int, Commits], recount: bool
    ) -> list[StepRecord]:
        """``records`` with each open one's progress and fragments: its commits from
        ``held`` where they agree with the row's counters (re-read after ``held`` when
        ``recount``), else from the database."""
        steps = [r.step for r in records if r.status is StepStatus.OPEN and r.step in held]
        found = open_live(self.sql.engine, run, steps, counters=recount)
        out = []
        for record in records:
            if record.status is not StepStatus.OPEN:
                out.append(record)
                continue
            commits = held.get(record.step)
            live = found[record.step] if commits is not None else None
            counters = None if live is None else live.counters if recount else record.counters
            if commits is not None and live is not None and agrees(commits, counters):
                progress = Progress(run.world_size, commits, live.received)
                cells = live.cells
            else:
                progress, cells = step_live(self.sql.engine, run, record.step)
            out.append(replace(record, progress=progress, fragments=cells))
        return out

    def _lost(self, exc: Exception) -> None:
        if self._redis_ok:
            log.warning(
                "Redis is unreachable (%s); timing out steps and reading progress from the "
                "database",
                exc,
            )
        self._redis_ok = False
