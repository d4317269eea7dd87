"""The SQL store: SQLite or PostgreSQL through SQLAlchemy Core.

SQL is the single durable source of truth. Nothing is cached here across
transactions, so a restart (even ``kill -9``) loses nothing acknowledged and any
number of instances over one database answer alike.

On SQLite one writer holds the database at a time: the writers of one store queue
on a lock of their own and take turns at once, instead of polling SQLite's busy
handler (which sleeps for milliseconds). Other processes still meet the busy timeout.

Ingests are group-committed (:mod:`.group_commit`): batches that arrive while a
transaction is in progress share the next one, so one ``COMMIT`` makes a whole group
durable. A group of one run whose batches touch different (step, rank) pairs (the
reporter's shape: one body per rank) runs as one batch's statements
(:func:`.sql_ingest.ingest_merged`) — on PostgreSQL in one round trip while nothing of
its pairs is stored yet (:func:`.sql_ingest.ingest_fresh`); any other group, or one
where that would change an answer, runs each batch in its own savepoint.
``group_max_batches=1`` turns grouping off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future

from sqlalchemy import Connection, Engine, select
from sqlalchemy.exc import IntegrityError

from steptally.service.domain.batch import PreparedBatch
from steptally.service.domain.progress import StepStatus
from steptally.service.domain.run import RunRecord, RunSnapshot, RunSummary
from steptally.service.domain.step import StepState, is_due
from steptally.service.errors import ServiceError
from steptally.service.store import sql_ingest, sql_query
from steptally.service.store.dialect import SqliteDialect, WriterLock, dialect_for
from steptally.service.store.engine import DatabaseLimits, make_engine, transaction, writing
from steptally.service.store.group_commit import GroupCommit, Pending
from steptally.service.store.migration import check_current
from steptally.service.store.pg_loop import LoopWriter
from steptally.service.store.protocol import (
    Answer,
    BreachRecord,
    Decide,
    FinalisedStep,
    IngestOutcome,
    SeriesRows,
    StepRecord,
)
from steptally.service.store.sql_ingest import Stored
from steptally.service.store.sql_postgres import PostgresDialect
from steptally.service.store.sql_run import KnownRuns, load_run, load_runs, save_run
from steptally.service.store.sql_series import read_series
from steptally.service.store.sql_statement import STEPS
from steptally.service.store.sql_step import RunKey, finalise_row, lock_step
from steptally.service.store.sqlite_loop import SqliteLoopWriter

log = logging.getLogger(__name__)


def writers_for(default: int, cores: int | None = None) -> int:
    """How many writer threads a store starts unless told: the database's ``default``,
    or one when the process may run on one core only (``serve --cpus``, ``taskset``, a
    container of one CPU; ``cores``: how many it may run on, its affinity unless given).

    On one core a second writer cannot run its statements beside the first's, only take
    turns with it — and each turn costs a thread switch and, on SQLite, the page cache of
    the connection that did not write last. Measured one process on one core, one writer
    took 3–12 % more rank-steps/s than two at 8, 256 and 4096 ranks on both databases,
    and workers each on a core of their own the same either way (bench/README.md, Scale)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    return 1 if cores == 1 else default


class SqlStore:
    """:class:`~steptally.service.store.protocol.Store` over one SQLAlchemy engine."""

    def __init__(
        self,
        engine: Engine,
        group_max_batches: int | None = None,
        group_max_bytes: int = 16 << 20,
        group_max_wait_s: float = 0.0,
        writers: int | None = None,
        group_linger_s: float = 0.0,
        loop_writer: bool = True,
        opened_at: float | None = None,
    ) -> None:
        """``group_max_batches`` None picks the database's default (see :mod:`.dialect`;
        1 turns grouping off); ``group_max_wait_s`` bounds a writer's wait for more
        batches, ``group_linger_s`` its wait for the rest of a burst (see
        :mod:`.group_commit`); ``writers`` None, the database's number of writer
        threads, or one in a process that may run on one core only
        (:func:`writers_for`); ``loop_writer``: the event loop writes the groups of plain
        pairs that it submits (on PostgreSQL :mod:`.pg_loop`, on a SQLite file
        :mod:`.sqlite_loop`); ``opened_at``: the moment the store opened on the clock of
        the steps' times (None: now, ``time.time()``), which :meth:`finalise_stranded`
        reads."""
        self.engine = engine
        self.opened_at = time.time() if opened_at is None else opened_at
        self.url = engine.url.render_as_string(hide_password=False)
        self.dialect = dialect_for(engine)
        self._recovered = False  # see finalise_stranded
        self._writers = self.dialect.writer_lock()
        self._runs = KnownRuns()  # the runs finalisations read, parsed once a change
        self._local = threading.local()  # a writer thread's own connection
        self._held: set[Connection] = set()  # every such connection, closed with the store
        self.group_max_batches = group_max_batches or self.dialect.default_group
        self._group = GroupCommit(
            self._ingest_group,
            self.group_max_batches,
            group_max_bytes,
            group_max_wait_s,
            writers or writers_for(self.dialect.default_writers),
            linger_s=group_linger_s,
        )
        # told, on the writer thread, of every group that committed (Redis coordination)
        self.after_group: Callable[[list[Pending]], None] | None = None
        self._on_loop = loop_writer and (
            isinstance(self.dialect, PostgresDialect)
            or (isinstance(self.dialect, SqliteDialect) and self.dialect.in_file)
        )
        self._linger_s = group_linger_s
        # each event loop's writer of plain groups (loop_writer)
        self._loop_writers: dict[asyncio.AbstractEventLoop, LoopWriter | SqliteLoopWriter] = {}

    @classmethod
    def from_url(
        cls,
        url: str,
        group_max_batches: int | None = None,
        group_max_bytes: int = 16 << 20,
        limits: DatabaseLimits | None = None,
        group_max_wait_s: float = 0.0,
        writers: int | None = None,
        group_linger_s: float = 0.0,
        notify: bool = False,
        loop_writer: bool = True,
        opened_at: float | None = None,
    ) -> SqlStore:
        """A store over ``url`` (see :meth:`__init__`), its engine bounded by ``limits``;
        ``notify``: on PostgreSQL, each finalisation announced to the other processes
        (:attr:`~.sql_postgres.PostgresDialect.notify`)."""
        engine = make_engine(url, limits)
        store = cls(
            engine,
            group_max_batches,
            group_max_bytes,
            group_max_wait_s,
            writers,
            group_linger_s,
            loop_writer,
            opened_at,
        )
        store.url = url
        if notify and isinstance(store.dialect, PostgresDialect):
            store.dialect.notify = True
        return store

    def close(self) -> None:
        for writer in self._loop_writers.values():
            writer.close()
        self._group.close()
        with self._writers:
            held, self._held = self._held, set()
        for conn in held:
            conn.close()
        self.engine.dispose()

    @contextlib.contextmanager
    def _write(self) -> Iterator[Connection]:
        """A write transaction: on a writer thread, on its own connection (kept from one
        group to the next, dropped after an error but the store's own refusals: a batch
        the rules refuse, a group that goes one batch at a time, rolled back on a
        connection as good as before); elsewhere, one from the pool."""
        conn: Connection | None = getattr(self._local, "conn", None)
        held = getattr(self._local, "locked", False)
        if conn is None and held:  # the group's connection was dropped: the lock is still ours
            conn = self._open_writer()
        if conn is None:
            with self._writers, transaction(self.engine, write=True) as conn:
                yield conn
            return
        lock = contextlib.nullcontext() if held else self._writers
        try:
            with lock, conn.begin():
                yield conn
        except (ServiceError, sql_ingest.NotMerged):
            if conn.invalidated or conn.in_transaction():  # not as good as before: drop it
                self._drop(conn)
            raise
        except BaseException:
            self._drop(conn)
            raise

    def _drop(self, conn: Connection) -> None:
        """Let a writer's connection go; the thread's next group opens another."""
        self._local.conn = None
        self._held.discard(conn)
        conn.invalidate()
        conn.close()

    @contextlib.contextmanager
    def _writer_connection(self) -> Iterator[None]:
        """Run the block (a group, on a writer thread) with the thread's own connection."""
        if getattr(self._local, "conn", None) is None:
            self._open_writer()
        yield

    def _open_writer(self) -> Connection:
        """A new connection of the thread's own for its groups."""
        conn = self.dialect.writer_connection(writing(self.engine.connect()))
        self._local.conn = conn
        self._held.add(conn)
        return conn

    def _reloader(self, conn: Connection, run: RunRecord) -> sql_ingest.KeyedReload:
        """What reads ``run`` as it stands now, when a step of it is finalised (its key:
        what of it can change, where the step's lock brought it along)."""

        def reload(key: RunKey | None = None) -> RunRecord:
            if key is None:
                key = self.dialect.run_key(conn, run.id)
                if key is None:
                    return run
            return self._runs.current(conn, run.id, key) or run

        return reload

    def check_ready(self) -> None:
        """Raise unless the database answers and its schema is at head (``NotMigrated``)."""
        with transaction(self.engine, write=False) as conn:
            conn.execute(select(1))
        check_current(self.engine, self.url)

    # -- runs -------------------------------------------------------------------------

    def register_run(self, name: str, decide: Decide, now: float = 0.0) -> tuple[RunRecord, bool]:
        for attempt in range(2):
            try:
                with self._write() as conn:
                    existing = load_run(conn, name=name, lock=self.dialect.for_update)
                    draft = decide(existing)
                    return save_run(conn, existing, name, draft, now), existing is None
            except IntegrityError:  # a concurrent first registration won the race
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def get_run(self, name: str) -> RunRecord | None:
        with transaction(self.engine, write=False) as conn:
            return load_run(conn, name=name)

    def list_runs(self, after: str | None = None, limit: int | None = None) -> list[RunSummary]:
        with transaction(self.engine, write=False) as conn:
            return sql_query.summaries(conn, load_runs(conn, after, limit))

    def run_summary(self, name: str) -> RunSummary | None:
        with transaction(self.engine, write=False) as conn:
            run = load_run(conn, name=name)
            return None if run is None else sql_query.summaries(conn, [run])[0]

    # -- fragments and steps ----------------------------------------------------------

    def ingest(self, run: RunRecord, batch: PreparedBatch, now: float) -> IngestOutcome:
        return self.submit(run, batch, now).result()

    def submit(self, run: RunRecord, batch: PreparedBatch, now: float) -> Future[IngestOutcome]:
        """:meth:`ingest` without waiting: the outcome once the batch's group committed."""
        return self._group.submit_future(run, batch, now)

    def submit_call(
        self,
        run: RunRecord,
        batch: PreparedBatch,
        now: float,
        loop: asyncio.AbstractEventLoop,
        answer: Answer,
    ) -> None:
        """:meth:`submit` answered on ``loop`` (:meth:`.GroupCommit.submit_call`); a batch
        of plain pairs is written by the loop itself (:mod:`.pg_loop`,
        :mod:`.sqlite_loop`), unless each group is to be told to ``after_group`` (on a
        writer thread)."""
        if self._loop_writes(batch):
            self._loop_writer(loop).submit(run, batch, now, answer)
            return
        self._group.submit_call(run, batch, now, loop, answer)

    def _loop_writes(self, batch: PreparedBatch) -> bool:
        """Whether the event loop writes ``batch`` itself (:mod:`.pg_loop`)."""
        return self._on_loop and self.after_group is None and batch.is_plain()

    def _loop_writer(self, loop: asyncio.AbstractEventLoop) -> LoopWriter | SqliteLoopWriter:
        writer = self._loop_writers.get(loop)
        if writer is None:
            args = (self.group_max_batches, self._linger_s, self._hand_over)
            if isinstance(self._writers, WriterLock):
                writer = SqliteLoopWriter(self, loop, self._writers, *args)
            else:
                writer = LoopWriter(self, loop, *args)
            self._loop_writers[loop] = writer
        return writer

    def _hand_over(self, p: Pending) -> None:
        """A batch the loop's writer leaves to the writer threads, answered from there."""
        assert p.answer is not None
        self._group.submit_call(p.run, p.batch, p.now, p.answer[0], p.answer[1])

    def queued(self) -> int:
        """Batches waiting for a writer."""
        return self._group.queued()

    def _ingest_alone(self, run: RunRecord, batch: PreparedBatch, now: float) -> IngestOutcome:
        with self._write() as conn:
            stored = sql_ingest.ingest(
                conn, self.dialect, run, batch, now, self._reloader(conn, run)
            )
        self._finalise_after(run, [stored], [now])
        return stored.outcome

    def store_held(self, group: list[Pending]) -> None:
        """Store a group (:meth:`_store_group`) on this thread's own connection, its
        caller holding the writer lock already (SQLite's event loop,
        :mod:`.sqlite_loop`); not synced: the caller syncs before it answers."""
        self._local.locked = True
        try:
            with self._writer_connection():
                self._store_group(group)
        finally:
            self._local.locked = False

    def _ingest_group(self, group: list[Pending]) -> None:
        """Store a group of batches (on a writer thread), then tell ``after_group``."""
        with self._writer_connection():
            self._store_group(group)
        self.dialect.sync()  # before any batch of the group is answered
        if self.after_group is not None:
            try:
                self.after_group(group)
            except Exception:  # it only coordinates: the batches are durable
                log.exception("after a group of %d batches", len(group))

    def _store_group(self, group: list[Pending]) -> None:
        """Store a group of batches in one transaction, each all-or-nothing in its own
        savepoint; sets each one's outcome or error. Raises (failing them all) if the
        transaction itself fails."""
        if len(group) == 1:  # no savepoint needed: the batch is the transaction
            p = group[0]
            try:
                p.outcome = self._ingest_alone(p.run, p.batch, p.now)
            except Exception as exc:
                p.error = exc
            return
        if len({p.run.id for p in group}) == 1 and self._ingest_merged(group):
            return
        with self._write() as conn:
            self.dialect.lock_group(conn, [(p.run, p.batch, p.now) for p in group])
            for p in group:
                try:
                    p.outcome = sql_ingest.ingest(
                        conn, self.dialect, p.run, p.batch, p.now, self._reloader(conn, p.run), True
                    ).outcome
                except Exception as exc:
                    p.error = exc

    def _ingest_merged(self, group: list[Pending]) -> bool:
        """Store a group of one run with one batch's statements (:func:`.sql_ingest.ingest_merged`);
        False, with nothing stored, when it has to go one savepoint per batch."""
        run = group[0].run
        try:
            with self._write() as conn:
                batches = [(p.batch, p.now) for p in group]
                reload = self._reloader(conn, run)
                stored = sql_ingest.ingest_fresh(
                    conn, self.dialect, run, batches, reload
                ) or sql_ingest.ingest_merged(conn, self.dialect, run, batches, reload)
        except Exception:  # NotMerged, or a batch the database refused: one by one
            return False
        try:
            self._finalise_after(run, stored, [p.now for p in group])
        finally:
            for p, one in zip(group, stored, strict=True):
                p.outcome = one.outcome
        return True

    def _finalise_after(self, run: RunRecord, stored: list[Stored], nows: list[float]) -> None:
        """Where the dialect finalises after the commit: the steps each committed batch
        completed (or changed after a partial finalisation), each in a transaction that
        locks its row, the finalisations added to that batch's outcome."""
        if not self.dialect.finalises_after_commit:
            return
        for one, now in zip(stored, nows, strict=True):
            steps = [r.step for r in sql_ingest.due(run.world_size, one.changed)]
            if not steps:
                continue
            try:
                with self._write() as conn:
                    reload = self._reloader(conn, run)
                    done = sql_ingest.finalise_due(
                        conn, self.dialect, run, reload, steps, now, last=True
                    )
            except Exception:  # the batch is durable: the sweep finalises its steps
                log.exception(
                    "finalising steps %s of run %r failed; the sweep will", steps, run.name
                )
                continue
            one.outcome.finalised.extend(done)

    def sweep(self, now: float, limit: int = 100) -> list[FinalisedStep]:
        """Finalise the open steps that are due (and, the first time, the stranded ones:
        :meth:`finalise_stranded`)."""
        with transaction(self.engine, write=False) as conn:
            due = conn.execute(
                select(STEPS.c.run_id, STEPS.c.step)
                .where(STEPS.c.status == StepStatus.OPEN.value, STEPS.c.deadline <= now)
                .order_by(STEPS.c.deadline)
                .limit(limit)
            ).all()
        out = self.finalise_stranded(now)
        for run_id, step in due:
            done = self.finalise_due(run_id, step, now)
            if done is not None:
                out.append(done)
        return out

    def finalise_stranded(self, now: float) -> list[FinalisedStep]:
        """Once per store, at its first sweep: finalise the steps whose counters say
        complete but that are open or partial, of those first seen before the store
        opened. On PostgreSQL a batch's steps are finalised after its commit; a process
        stopped between the two leaves them so (the deadline would finalise them too,
        later). A step first seen since is left to the batch that completes it, which
        finalises it after its commit: the first sweep may come late (the database
        unreachable until then) and land between the two."""
        if self._recovered or not self.dialect.finalises_after_commit:
            return []
        c = STEPS.c
        with transaction(self.engine, write=False) as conn:
            rows = conn.execute(
                select(c.run_id, c.step).where(
                    c.status.in_([StepStatus.OPEN.value, StepStatus.PARTIAL.value]),
                    c.missing_ranks == 0,
                    c.received == c.expected,
                    c.first_seen_at < self.opened_at,
                )
            ).all()
        out = [done for run_id, step in rows if (done := self.finalise_due(run_id, step, now))]
        self._recovered = True
        return out

    def finalise_due(self, run_id: int, step: int, now: float) -> FinalisedStep | None:
        """Finalise one step if it is still open and due at ``now`` (as partial unless it
        is complete), or complete."""
        with self._write() as conn:
            row = lock_step(conn, self.dialect.for_update, run_id, step)
            if row is None or not (is_due(row, now) or _is_stranded(row)):
                return None  # another instance got there first
            key = self.dialect.run_key(conn, run_id)
            run = None if key is None else self._runs.current(conn, run_id, key)
            assert run is not None
            done = finalise_row(conn, self.dialect.read_parts, run, row, None, now)
            self.dialect.write_steps(conn, run_id, [row])
            return done

    def deadline_of(self, run_id: int, step: int) -> float | None:
        """An open step's deadline; None when it is not open (or not there)."""
        with transaction(self.engine, write=False) as conn:
            return conn.execute(
                select(STEPS.c.deadline).where(
                    STEPS.c.run_id == run_id,
                    STEPS.c.step == step,
                    STEPS.c.status == StepStatus.OPEN.value,
                )
            ).scalar_one_or_none()

    def open_deadlines(self) -> Iterator[tuple[int, int, float]]:
        """Every open step as ``(run_id, step, deadline)``, read in one transaction."""
        with transaction(self.engine, write=False) as conn:
            rows = conn.execute(
                select(STEPS.c.run_id, STEPS.c.step, STEPS.c.deadline).where(
                    STEPS.c.status == StepStatus.OPEN.value
                )
            ).all()
        for run_id, step, deadline in rows:
            yield int(run_id), int(step), float(deadline)

    def get_step(self, run: RunRecord, step: int, live: bool = True) -> StepRecord | None:
        with transaction(self.engine, write=False) as conn:
            return sql_query.get_step(conn, run, step, live)

    def list_steps(
        self, run: RunRecord, start: int | None, end: int | None, limit: int, live: bool = True
    ) -> list[StepRecord]:
        with transaction(self.engine, write=False) as conn:
            return sql_query.list_steps(conn, run, start, end, limit, live)

    def series(
        self, run: RunRecord, col: int, start: int | None, end: int | None, points: int | None
    ) -> SeriesRows:
        with transaction(self.engine, write=False) as conn:
            return read_series(conn, self.dialect.downsample, run.id, col, start, end, points)

    def finalised_since(
        self, run: RunRecord, after: tuple[float, int], limit: int
    ) -> list[StepRecord]:
        with transaction(self.engine, write=False) as conn:
            return sql_query.finalised_since(conn, run, after, limit)

    def newest_finalised(self, run: RunRecord) -> tuple[float, int, int] | None:
        with transaction(self.engine, write=False) as conn:
            return sql_query.newest_finalised(conn, run)

    def breaches(
        self,
        run: RunRecord,
        start: int | None,
        end: int | None,
        rules: Sequence[str] | None,
        after: tuple[int, str] | None,
        limit: int,
    ) -> list[BreachRecord]:
        with transaction(self.engine, write=False) as conn:
            return sql_query.breaches(conn, run, start, end, rules, after, limit)

    def exposition_snapshot(self) -> list[RunSnapshot]:
        with transaction(self.engine, write=False) as conn:
            return sql_query.snapshot(conn, load_runs(conn))


def _is_stranded(row: StepState) -> bool:
    """Complete by its counters, yet open or partial."""
    return (
        row.status is not StepStatus.COMPLETE
        and row.missing_ranks == 0
        and row.received == row.expected
    )
