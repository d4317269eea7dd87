"""What differs between SQLite and PostgreSQL, as one object per backend.

A :class:`~steptally.service.store.sql.SqlStore` picks its :class:`Dialect` once, from
its engine (:func:`dialect_for`); nothing else in the store asks which database it
talks to. A dialect brings:

* ``sql``: its :class:`~steptally.service.store.sql_statement.Statements`;
* ``default_group``: how many batches share a transaction unless set (64 on both: a
  commit is an fsync, and on PostgreSQL every statement a round trip's worth of work,
  that grouping saves), and ``default_writers``: how many writer threads take the
  groups (2 on both: SQLite's writers take turns, one syncing its commit while the next
  runs its statements; PostgreSQL's run side by side; a process on one core starts one:
  :func:`~.sql.writers_for`; see ``bench/README.md``, Scale);
* ``writer_connection`` and ``sync``: a writer thread's own connection, and what makes
  its commits durable before the group's batches are answered (SQLite syncs its WAL
  once a group, outside the writer lock; PostgreSQL's commit is durable);
* ``writer_lock()``: what the writers queue on (SQLite has one writer at a time, in
  every process: :class:`WriterLock`; PostgreSQL locks pairs and rows);
* ``for_update(stmt)``: a read that locks its rows until the transaction ends;
* ``probe`` and ``apply``: the two ends of a batch's transaction, around the step
  rules (:mod:`.sql_ingest`): hold the batch's (step, rank) pairs and read back what
  the checks need; then write the new rows, the partial rows and the steps' counters;
* ``store_fresh``: where the dialect can, a batch of which nothing is stored yet, the
  checks and the writes in one go (PostgreSQL: one round trip; SQLite: plain pairs
  inserted without the probe's read, inside the group's transaction);
* ``write_steps``: a finalisation's step rows and values (and breaches);
* ``read_parts``: a step's partial rows and commits, for its finalisation, and
  ``run_key``: what of its run can change (a run is parsed again only when it did);
* ``finalises_after_commit``: whether a batch stored alone commits in ``apply`` and has
  its steps finalised in a transaction of their own (PostgreSQL, where a step's row is
  then locked only while its counters change) or inside its own (SQLite);
* ``lock_group``: hold up front every pair a group of batches touches, where writers
  run side by side (so groups of several replicas never wait in a circle);
* ``downsample``: a long series' kept steps in one statement (:mod:`.sql_series`).

:class:`SqliteDialect` sends its statements through the driver, one at a time;
:class:`~.sql_postgres.PostgresDialect` pipelines them: one round trip a batch of
which nothing is stored yet (``store_fresh``), else two.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from sqlalchemy import Connection, Engine, Select
from sqlalchemy.dialects import sqlite

from steptally.service.domain.batch import CommitKey, FragmentKey, PreparedBatch
from steptally.service.domain.finalise import StoredValue
from steptally.service.domain.packing import unbundled
from steptally.service.domain.run import RunRecord
from steptally.service.domain.step import Delta, Probe, StepState, opened, probe_from
from steptally.service.store import sql_series
from steptally.service.store.sql_postgres import PostgresDialect
from steptally.service.store.sql_statement import SQLITE, STEP_FIELDS, RowsInsert, Statements, core
from steptally.service.store.sql_step import (
    Locked,
    PartialRow,
    RunKey,
    StepParts,
    fragment_rows,
    lock_steps_of,
    pending_values,
    state_of_tuple,
    step_tuple,
    write_breaches,
)

GroupItem = tuple[RunRecord, PreparedBatch, float]  # a batch of a group, and its time
#: the savepoint around SQLite's plain write (:meth:`SqliteDialect.store_fresh`)
FRESH_SAVEPOINT = "steptally_fresh"


class Dialect(Protocol):
    name: str
    sql: Statements
    default_group: int
    default_writers: int
    finalises_after_commit: bool  # a batch alone: its steps finalised after its commit

    def writer_lock(self) -> contextlib.AbstractContextManager[object]: ...

    def writer_connection(self, conn: Connection) -> Connection:
        """Set up a writer thread's own connection (kept from one group to the next)."""
        ...

    def sync(self) -> None:
        """Make durable what a writer's connection committed (after its transactions,
        outside the writer lock), where its commits leave that to it."""
        ...

    def for_update(self, stmt: Select[Any]) -> Select[Any]: ...

    def probe(
        self,
        conn: Connection,
        run: RunRecord,
        batch: PreparedBatch,
        now: float,
        savepoint: str | None,
    ) -> Probe:
        """Hold the batch's (step, rank) pairs and read back what
        :func:`~steptally.service.domain.step.check` needs (the dialect may insert the
        fragments and commits here); ``savepoint``: open it first."""
        ...

    def apply(
        self,
        conn: Connection,
        run: RunRecord,
        batch: PreparedBatch,
        found: Probe,
        added: Mapping[int, Delta],
        partials: Sequence[PartialRow],
        now: float,
        alone: bool,
    ) -> list[StepState]:
        """Write what the probe did not (the new fragments and commits), the
        ``partials`` rows and the steps' counters (``added`` to what they held, a new
        step first seen at ``now``); returns the steps ``added`` names as they now stand,
        changed. ``alone``: the batch is the whole transaction (a dialect that
        finalises after commit commits it here)."""
        ...

    def store_fresh(
        self,
        conn: Connection,
        run: RunRecord,
        batch: PreparedBatch,
        added: Mapping[int, Delta],
        partials: Sequence[PartialRow],
        now: float,
    ) -> list[StepState] | None:
        """Store ``batch``, if nothing of its (step, rank) pairs is stored and none of
        its steps is finalised (then each of its fragments and commits is new,
        ``partials`` its pairs' whole partial rows and ``added`` what it adds to its
        steps): the steps as :meth:`apply` returns them. A dialect that finalises after
        the commit makes the batch the whole transaction and commits it; one that
        finalises inside writes it in the transaction it is given. None when that does
        not hold (or the dialect has no such path for this batch), with nothing written:
        the batch then takes :meth:`probe` and :meth:`apply`."""
        ...

    def write_steps(
        self, conn: Connection, run_id: int, rows: Sequence[StepState], last: bool = False
    ) -> None:
        """Write the changed step ``rows`` and, of those finalised in this transaction,
        their values (each replacing the step's earlier value of its column) and the
        breaches they found. ``last``: the transaction ends with these writes (a
        dialect may commit it with them; the caller's commit then finds it done)."""
        ...

    def read_parts(self, conn: Connection, run_id: int, step: int) -> StepParts:
        """A step's partial rows ``(rank, fragments, state)`` and commits ``(rank,
        fragments)``: what its finalisation merges."""
        ...

    def lock_steps(self, conn: Connection, run_id: int, steps: Sequence[int]) -> Locked:
        """The rows of ``steps`` that exist, locked in step order, what reads a step's
        parts from then on (:meth:`read_parts`, or the same read made with the lock) and
        the run's key, where it comes with them."""
        ...

    def run_key(self, conn: Connection, run_id: int) -> RunKey | None:
        """What of the run can change (:class:`~.sql_run.KnownRuns` compares it), as it
        stands in this transaction; None: no such run."""
        ...

    def lock_group(self, conn: Connection, batches: Sequence[GroupItem]) -> None:
        """Hold, up front and in one order, every pair a group of batches will touch
        (so that groups of several writers never wait on each other in a circle)."""
        ...

    def downsample(
        self, conn: Connection, params: dict[str, Any], in_range: list[Any]
    ) -> tuple[Sequence[Any], int]:
        """A series' kept rows and its number of finalised steps (:mod:`.sql_series`)."""
        ...


class WriterLock:
    """SQLite's writers, queued: a thread lock, then (for a database in a file) an
    exclusive ``flock`` of ``<database>-writer.lock``, so that the writers of every
    process on one database (``serve --workers N``) take turns as soon as the one before
    them commits, instead of sleeping in SQLite's busy handler and retrying."""

    def __init__(self, database: str | None) -> None:
        self._thread = threading.Lock()
        self._path = f"{database}-writer.lock" if database and database != ":memory:" else None
        self._fd: int | None = None

    def __enter__(self) -> WriterLock:
        self._thread.acquire()
        if self._path is not None:
            try:
                if self._fd is None:
                    self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            except BaseException:
                self._thread.release()
                raise
        return self

    def __exit__(self, *_: object) -> None:
        try:
            if self._fd is not None:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread.release()

    def try_enter(self) -> bool:
        """Take the lock if no writer holds it, without waiting; whether it did (then
        ``__exit__`` lets it go). For the event loop, which must not wait for another
        process's transaction."""
        if not self._thread.acquire(blocking=False):
            return False
        if self._path is not None:
            try:
                if self._fd is None:
                    self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._thread.release()
                return False
            except BaseException:
                self._thread.release()
                raise
        return True


class SqliteDialect:
    """SQLite: one writer at a time (the whole database is its lock), queued on a
    :class:`WriterLock`; the statements of :data:`.sql_statement.SQLITE`, through the
    driver. It reads before it writes, so it inserts only what is new."""

    name = "sqlite"
    sql = core(sqlite.insert)
    default_group = 64
    default_writers = 2  # one's sync (outside the writer lock) beside the other's statements
    finalises_after_commit = False

    def __init__(self, database: str | None = None) -> None:
        self._database = database

    @property
    def in_file(self) -> bool:
        """Whether the database is a file (not in memory, where each connection has a
        database of its own)."""
        return bool(self._database) and self._database != ":memory:"

    def writer_lock(self) -> contextlib.AbstractContextManager[object]:
        return WriterLock(self._database)

    def writer_connection(self, conn: Connection) -> Connection:
        """A writer's connection commits without waiting for the disk (``synchronous =
        NORMAL``: the WAL is written, not synced); :meth:`sync` syncs it after the group,
        outside the writer lock, before any batch is answered. So the next group's
        statements run while this one's sync waits on the disk, and one sync covers
        every commit before it. Other connections keep ``FULL``."""
        if self._database and self._database != ":memory:":  # outside any transaction
            _driver(conn).execute("PRAGMA synchronous = NORMAL")
        return conn

    def sync(self) -> None:
        """``fdatasync`` the database's WAL: every commit written to it so far is durable
        (SQLite appends commits to the WAL in order). The file is opened anew each time:
        the WAL a stale descriptor named could have been replaced."""
        if not self._database or self._database == ":memory:":
            return
        try:
            fd = os.open(f"{self._database}-wal", os.O_RDONLY)
        except FileNotFoundError:  # checkpointed into the database and removed: synced
            return
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def for_update(self, stmt: Select[Any]) -> Select[Any]:
        return stmt  # the write transaction (BEGIN IMMEDIATE) holds the whole database

    def probe(
        self,
        conn: Connection,
        run: RunRecord,
        batch: PreparedBatch,
        now: float,
        savepoint: str | None,
    ) -> Probe:
        """The stored steps, partial rows and commits of the batch's pairs (one
        statement), then the stored fragment keys of the pairs that have any."""
        db = _driver(conn)
        if savepoint is not None:
            db.execute(f"SAVEPOINT {savepoint}")
        text, run_id = SQLITE, run.id
        steps_wanted = batch.steps()
        pairs = batch.pairs()
        steps_json, ranks_json = _json(steps_wanted), _json({p[1] for p in pairs})
        steps: dict[int, StepState] = {}
        parts: dict[CommitKey, tuple[int, bytes]] = {}
        stored_commits: dict[CommitKey, int] = {}
        by_pair = (run_id, steps_json, ranks_json)
        for row in db.execute(text.stored_of, (run_id, steps_json, *by_pair, *by_pair)):
            if row[0] == 0:
                steps[row[2]] = state_of_tuple(row[1:])
            elif (row[1], row[2]) not in pairs:
                continue
            elif row[0] == 1:
                parts[(row[1], row[2])] = (row[3], bytes(row[4]))
            else:
                stored_commits[(row[1], row[2])] = row[3]
        stored: set[FragmentKey] = set()
        if parts:  # a pair without a partial row has no fragment stored
            params = (run_id, _json({p[0] for p in parts}), _json({p[1] for p in parts}))
            for st, r, key, seqs in db.execute(text.fragment_keys_of, params):
                if (st, r) in parts:
                    stored.update((st, r, q) for q, _ in unbundled(key, b"", None, None, seqs))
        return probe_from(run, batch, now, steps, stored, stored_commits, parts)

    def apply(
        self,
        conn: Connection,
        run: RunRecord,
        batch: PreparedBatch,
        found: Probe,
        added: Mapping[int, Delta],
        partials: Sequence[PartialRow],
        now: float,
        alone: bool,
    ) -> list[StepState]:
        """The new fragments, commits and partial rows, then each changed step's row
        with its counters as the probe read them plus ``added`` (one writer: they are
        current)."""
        db, run_id, text = _driver(conn), run.id, SQLITE
        commits = batch.commits
        _insert(db, text.insert_fragments, fragment_rows(run_id, batch, found.new_frags))
        _insert(db, text.insert_commits, [(run_id, *k, commits[k]) for k in found.new_commits])
        _insert(db, text.upsert_partials, [(run_id, *row) for row in partials])
        changed = [found.steps[s] for s in sorted(added)]
        _insert(db, text.upsert_steps, [step_tuple(run_id, row) for row in changed])
        return changed

    def store_fresh(
        self,
        conn: Connection,
        run: RunRecord,
        batch: PreparedBatch,
        added: Mapping[int, Delta],
        partials: Sequence[PartialRow],
        now: float,
    ) -> list[StepState] | None:
        """A batch of plain pairs (what a reporter sends) written inside the group's
        transaction without the probe's read: each fragments, commits and partial row
        inserted as it is, so that a pair with anything stored breaks a table's key, and
        each step's counters added to its row where it is open (``add_to_steps``: a step
        of another status keeps its row and is missing from the rows it returns). Where
        either happens, the savepoint around them is rolled back (nothing written) and
        None returned: the probe's path then says what the batch is. Any other batch:
        None at once. The probe, and the rules over what it read, cost the writer ~30 %
        of a group's CPU (bench/README.md, Scale)."""
        if not batch.is_plain():
            return None
        db, run_id, text = _driver(conn), run.id, SQLITE
        steps = [step_tuple(run_id, _opened_with(run, s, added[s], now)) for s in sorted(added)]
        db.execute(f"SAVEPOINT {FRESH_SAVEPOINT}")
        try:
            _insert(db, text.insert_fragments, fragment_rows(run_id, batch, list(batch.fragments)))
            _insert(db, text.insert_commits, [(run_id, *k, n) for k, n in batch.commits.items()])
            _insert(db, text.insert_partials, [(run_id, *row) for row in partials])
            changed = [state_of_tuple(r) for r in _returning(db, text.add_to_steps, steps)]
        except sqlite3.IntegrityError:  # a pair stored already
            changed = []
        if len(changed) < len(steps):  # that, or a step finalised
            db.execute(f"ROLLBACK TO SAVEPOINT {FRESH_SAVEPOINT}")
            db.execute(f"RELEASE SAVEPOINT {FRESH_SAVEPOINT}")
            return None
        db.execute(f"RELEASE SAVEPOINT {FRESH_SAVEPOINT}")
        for row in changed:
            row.changed = True
        changed.sort(key=lambda r: r.step)
        return changed

    def write_steps(
        self, conn: Connection, run_id: int, rows: Sequence[StepState], last: bool = False
    ) -> None:
        """The breaches (rare), the values, then the changed rows, each by its key through
        the driver (SQLAlchemy's statement cost a finalisation ~40 µs more CPU)."""
        write_breaches(conn, self.sql, run_id, rows)
        first, revised = pending_values(rows)
        if first:
            self._write_values(conn, SQLITE.insert_values, run_id, first)
        if revised:
            self._write_values(conn, SQLITE.upsert_values, run_id, revised)
        changed = [
            (r.status.value, *(getattr(r, c) for c in STEP_FIELDS[1:]), run_id, r.step)
            for r in rows
            if r.changed
        ]
        _driver(conn).executemany(SQLITE.update_step, changed)

    def _write_values(
        self,
        conn: Connection,
        text: RowsInsert,
        run_id: int,
        values: Sequence[tuple[int, StoredValue]],
    ) -> None:
        """One statement through the driver (SQLAlchemy's executemany made each row's
        parameters in Python: a third of a finalisation's CPU at 8 ranks)."""
        rows = [(run_id, c, s, v, st) for s, (c, v, st) in values]
        _insert(_driver(conn), text, rows)

    def read_parts(self, conn: Connection, run_id: int, step: int) -> StepParts:
        """One statement through the driver (two of SQLAlchemy's cost a finalisation
        ~50 µs more CPU)."""
        parts: list[tuple[int, int, bytes]] = []
        commits: list[tuple[int, int]] = []
        params = (run_id, step, run_id, step)
        for kind, rank, n, state in _driver(conn).execute(SQLITE.parts_of_step, params):
            if kind == 0:
                parts.append((rank, n, bytes(state)))
            else:
                commits.append((rank, n))
        return parts, commits

    def lock_steps(self, conn: Connection, run_id: int, steps: Sequence[int]) -> Locked:
        return Locked(lock_steps_of(conn, self.for_update, run_id, steps), self.read_parts, None)

    def run_key(self, conn: Connection, run_id: int) -> RunKey | None:
        row = _driver(conn).execute(SQLITE.run_key, (run_id, run_id)).fetchone()
        return None if row is None else tuple(row)

    def lock_group(self, conn: Connection, batches: Sequence[GroupItem]) -> None:
        pass  # the group's transaction holds the whole database already

    def downsample(
        self, conn: Connection, params: dict[str, Any], in_range: list[Any]
    ) -> tuple[Sequence[Any], int]:
        return sql_series.downsampled(conn, params, in_range)


def _driver(conn: Connection) -> Any:
    db = conn.connection.driver_connection
    assert db is not None
    return db


#: the most parameters one statement takes (SQLite's limit since 3.32 is 32766)
MAX_PARAMETERS = 32_000


def _insert(db: Any, stmt: RowsInsert, rows: Sequence[tuple[Any, ...]]) -> None:
    """``rows`` in as few statements as the parameter limit allows."""
    per = max(1, MAX_PARAMETERS // stmt.columns)
    for at in range(0, len(rows), per):
        chunk = rows[at : at + per]
        db.execute(stmt.text(len(chunk)), [v for row in chunk for v in row])


def _returning(db: Any, stmt: RowsInsert, rows: Sequence[tuple[Any, ...]]) -> list[Any]:
    """:func:`_insert` of a statement that returns rows: every row it returns."""
    per = max(1, MAX_PARAMETERS // stmt.columns)
    out: list[Any] = []
    for at in range(0, len(rows), per):
        chunk = rows[at : at + per]
        out += db.execute(stmt.text(len(chunk)), [v for row in chunk for v in row]).fetchall()
    return out


def _opened_with(run: RunRecord, step: int, added: Delta, now: float) -> StepState:
    """A new step's row holding what ``added`` brings it (the row a plain write inserts,
    or whose counters it adds to a stored one's)."""
    row = opened(run, step, now)
    row.committed_ranks, row.expected, row.received = (
        added.committed,
        added.expected,
        added.received,
    )
    row.missing_ranks = run.world_size - added.committed
    return row


def _json(numbers: Iterable[int]) -> str:
    return "[" + ",".join(map(str, sorted(numbers))) + "]"


def dialect_for(engine: Engine) -> Dialect:
    """The dialect of ``engine``'s database: the one place that looks at its name."""
    dialects: dict[str, Callable[[], Dialect]] = {
        SqliteDialect.name: lambda: SqliteDialect(engine.url.database),
        PostgresDialect.name: PostgresDialect,
    }
    try:
        return dialects[engine.dialect.name]()
    except KeyError:
        raise ValueError(
            f"steptally stores its data in SQLite or PostgreSQL, not {engine.dialect.name}"
        ) from None
