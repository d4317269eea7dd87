"""What differs between SQLite and PostgreSQL, as one object per backend.

A :class:`~steptally.service.store.sql.SqlStore` picks its :class:`Dialect` once, from
its engine (:func:`dialect_for`); nothing else in the store asks which database it
talks to. A dialect brings:

* ``sql``: its :class:`~steptally.service.store.sql_statement.Statements`;
* ``default_group``: how many batches share a transaction unless set (SQLite 64, where
  each commit is an fsync that grouping saves; PostgreSQL 1: grouping gains a lone
  replica about half its throughput but cost two replicas on one database a third of
  theirs, see ``bench/README.md``, Scale);
* ``writer_lock()``: what the writers of one store queue on (SQLite has one writer at a
  time; PostgreSQL locks rows);
* ``for_update(stmt)``: a read that locks its rows until the transaction ends;
* ``probe`` and ``finish``: the two ends of a batch's transaction, around the step
  rules (:mod:`.sql_ingest`): lock the steps, insert, read back what the checks need;
  then write the step rows and values, and commit or release the batch's savepoint;
* ``lock_group``: lock up front every step a group of batches touches, where the
  database has row locks (so groups of several replicas never deadlock);
* ``downsample``: a long series' kept steps in one statement (:mod:`.sql_series`).

:class:`SqliteDialect` runs plain Core statements; :class:`~.sql_postgres.PostgresDialect`
pipelines them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from sqlalchemy import Connection, Engine, Select
from sqlalchemy.dialects import sqlite

from steptally.service.domain.batch import CommitKey, FragmentKey, PreparedBatch
from steptally.service.domain.packing import Cell
from steptally.service.domain.run import RunRecord
from steptally.service.domain.step import Probe, StepState
from steptally.service.store import sql_series
from steptally.service.store.sql_postgres import PostgresDialect
from steptally.service.store.sql_statement import Statements, core, keys_params
from steptally.service.store.sql_step import PartialRow, lock_steps, upsert_partials, write_steps

GroupItem = tuple[RunRecord, PreparedBatch, float]  # a batch of a group, and its time


class Dialect(Protocol):
    name: str
    sql: Statements
    default_group: int

    def writer_lock(self) -> contextlib.AbstractContextManager[object]: ...

    def for_update(self, stmt: Select[Any]) -> Select[Any]: ...

    def probe(
        self,
        conn: Connection,
        run: RunRecord,
        batch: PreparedBatch,
        now: float,
        savepoint: str | None,
    ) -> Probe:
        """Lock (or create) the batch's steps, insert its fragments and commits, and read
        back what :func:`~steptally.service.domain.step.check` needs; ``savepoint``:
        open it first."""
        ...

    def finish(
        self,
        conn: Connection,
        run_id: int,
        rows: Sequence[StepState],
        savepoint: str | None,
        partials: Sequence[PartialRow] = (),
    ) -> None:
        """Write the changed step rows (and the values of those finalised) and the
        ``partials`` rows; then release ``savepoint``, or (None) leave the transaction
        durable or for the caller to commit."""
        ...

    def lock_group(self, conn: Connection, batches: Sequence[GroupItem]) -> bool:
        """Create and lock every step row of a group up front; whether it did (then the
        rows only failed batches wanted are dropped with :meth:`drop_empty_steps`)."""
        ...

    def drop_empty_steps(self, conn: Connection, run_id: int, steps: Sequence[int]) -> None: ...

    def downsample(
        self, conn: Connection, params: dict[str, Any], in_range: list[Any]
    ) -> tuple[Sequence[Any], int]:
        """A series' kept rows and its number of finalised steps (:mod:`.sql_series`)."""
        ...


class SqliteDialect:
    """SQLite: one writer at a time, queued on the store's own lock; plain statements."""

    name = "sqlite"
    sql = core(sqlite.insert)
    default_group = 64

    def writer_lock(self) -> contextlib.AbstractContextManager[object]:
        return threading.Lock()

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
        """The probe as plain statements, reading only what the checks will use."""
        if savepoint is not None:
            conn.exec_driver_sql(f"SAVEPOINT {savepoint}")
        sql = self.sql
        steps = lock_steps(conn, sql, run, batch.steps(), now)
        new_frags = _insert(conn, sql.insert_fragments, run, batch.fragments, _fragment_row)
        new_commits = _insert(conn, sql.insert_commits, run, batch.commits, _commit_row)
        fresh = set(new_commits)
        # a pair committed in this batch had no commit before; others may, if the step has any
        wanted = (set(batch.commits) - fresh) | {
            (s, r) for s, r, _ in new_frags if (s, r) not in fresh and steps[s].committed_ranks
        }
        declared = {k: batch.commits[k] for k in fresh}
        if wanted:
            for s, r, n in conn.execute(sql.commits_of, keys_params(run.id, wanted)):
                if (s, r) in wanted:
                    declared[(s, r)] = n
        top_seq = {}
        if fresh:
            for s, r, top in conn.execute(sql.max_seq_of, keys_params(run.id, fresh)):
                if (s, r) in fresh:
                    top_seq[(s, r)] = top
        return Probe(steps, new_frags, new_commits, declared, top_seq)

    def finish(
        self,
        conn: Connection,
        run_id: int,
        rows: Sequence[StepState],
        savepoint: str | None,
        partials: Sequence[PartialRow] = (),
    ) -> None:
        upsert_partials(conn, self.sql, run_id, list(partials))
        write_steps(conn, self.sql, run_id, rows)
        if savepoint is not None:
            conn.exec_driver_sql(f"RELEASE SAVEPOINT {savepoint}")

    def lock_group(self, conn: Connection, batches: Sequence[GroupItem]) -> bool:
        return False  # the group's transaction holds the whole database already

    def drop_empty_steps(self, conn: Connection, run_id: int, steps: Sequence[int]) -> None:
        pass  # lock_group creates no rows

    def downsample(
        self, conn: Connection, params: dict[str, Any], in_range: list[Any]
    ) -> tuple[Sequence[Any], int]:
        return sql_series.downsampled(conn, params, in_range)


def _fragment_row(run_id: int, key: FragmentKey, cell: Cell) -> dict[str, Any]:
    s, r, q = key
    return {
        "run_id": run_id,
        "step": s,
        "rank": r,
        "seq": q,
        "values_f64": cell[0],
        "present": cell[1],
        "tails": cell[2],
    }


def _commit_row(run_id: int, key: CommitKey, n: int) -> dict[str, Any]:
    return {"run_id": run_id, "step": key[0], "rank": key[1], "fragments": n}


def _insert(
    conn: Connection,
    stmt: Any,
    run: RunRecord,
    items: Mapping[Any, Any],
    row: Callable[[int, Any, Any], dict[str, Any]],
) -> list[Any]:
    """Insert ``items`` with ``ON CONFLICT DO NOTHING``; the keys that were new."""
    if not items:
        return []
    params = [row(run.id, k, v) for k, v in items.items()]
    return [tuple(k) for k in conn.execute(stmt, params)]


def dialect_for(engine: Engine) -> Dialect:
    """The dialect of ``engine``'s database: the one place that looks at its name."""
    dialects: dict[str, Callable[[], Dialect]] = {
        SqliteDialect.name: SqliteDialect,
        PostgresDialect.name: PostgresDialect,
    }
    try:
        return dialects[engine.dialect.name]()
    except KeyError:
        raise ValueError(
            f"steptally stores its data in SQLite or PostgreSQL, not {engine.dialect.name}"
        ) from None
