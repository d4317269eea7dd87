"""PostgreSQL's dialect: the ingest hot path's statements, pipelined.

A batch's transaction holds its steps' row locks from the first statement to the
commit, so every round trip inside it is time that other writers of the step wait.
Here the statements that do not depend on each other's answers travel together in
one psycopg pipeline, in the order SQLite's path runs them (lock the steps, insert
fragments and commits, read back what the checks need), and the step rows' update
travels with the ``COMMIT``: two round trips under the lock instead of six.

Each statement still runs on its own, in order, with its own snapshot (READ
COMMITTED), so the reads see everything committed before the lock was granted and
this transaction's own inserts. The texts are :data:`.sql_statement.PIPELINE`.

A batch of :data:`COPY_MIN_ROWS` fragments or more sends them by binary ``COPY``
before the pipeline (a ``COPY`` cannot run inside one), into a table of the session
that the pipeline's ``INSERT ... SELECT`` empties.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from psycopg.rows import namedtuple_row
from sqlalchemy import Connection, Select
from sqlalchemy.dialects import postgresql

from steptally.service.domain.batch import CommitKey, PreparedBatch
from steptally.service.domain.finalise import StoredValue
from steptally.service.domain.progress import StepStatus
from steptally.service.domain.run import RunRecord
from steptally.service.domain.step import Probe, StepState
from steptally.service.store import sql_series
from steptally.service.store.sql_statement import PIPELINE, STEP_FIELDS, core, keys_params
from steptally.service.store.sql_step import (
    PartialRow,
    new_row,
    pending_values,
    state_of,
    write_breaches,
)

#: a batch (or a merged group) of at least this many fragments is copied (binary
#: ``COPY`` into a session table, then one ``INSERT ... SELECT``) rather than sent as
#: arrays: the insert alone takes 0.55x the time at 4096 rows, but the copy costs two
#: round trips of its own, and at 512 rows end to end it gained nothing (bench/README.md)
COPY_MIN_ROWS = 2048


class PostgresDialect:
    """PostgreSQL: row locks (``FOR UPDATE``), a batch in two pipelined round trips."""

    name = "postgresql"
    sql = core(postgresql.insert)
    default_group = 1

    def writer_lock(self) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()  # writers meet on the rows they lock

    def for_update(self, stmt: Select[Any]) -> Select[Any]:
        return stmt.with_for_update()

    def probe(
        self,
        conn: Connection,
        run: RunRecord,
        batch: PreparedBatch,
        now: float,
        savepoint: str | None,
    ) -> Probe:
        """Lock the batch's steps, insert its fragments and commits, and read back the
        commits and top sequence numbers of its (step, rank) pairs: one round trip.
        With ``savepoint``, the pipeline opens that savepoint first."""
        driver = conn.connection.driver_connection
        assert driver is not None
        pairs = {k[:2] for k in batch.fragments} | set(batch.commits)
        lock_params = _lock_params(run, batch.steps(), now)
        copied = len(batch.fragments) >= COPY_MIN_ROWS
        if copied:  # inside the savepoint, so that its rollback takes the copied rows too
            if savepoint is not None:
                driver.execute(f"SAVEPOINT {savepoint}")
                savepoint = None
            _copy_fragments(driver, run, batch)
        frag_params = _fragment_params(run, batch) if batch.fragments and not copied else None
        commit_params = _commit_params(run, batch) if batch.commits else None
        pair_params = keys_params(run.id, pairs)
        top_params = keys_params(run.id, batch.commits) if batch.commits else None
        frag_pairs = keys_params(run.id, {k[:2] for k in batch.fragments})
        locked = driver.cursor(row_factory=namedtuple_row)
        frags, commits, declared, tops, parts = (driver.cursor() for _ in range(5))
        with driver.pipeline():
            if savepoint is not None:
                driver.execute(f"SAVEPOINT {savepoint}")
            locked.execute(PIPELINE.lock_steps, lock_params)
            if frag_params is not None:
                frags.execute(PIPELINE.insert_fragments, frag_params)
            elif copied:
                frags.execute(PIPELINE.insert_copied)
                driver.execute(PIPELINE.clear_copied)
            if commit_params is not None:
                commits.execute(PIPELINE.insert_commits, commit_params)
            declared.execute(PIPELINE.commits_of, pair_params)
            if top_params is not None:
                tops.execute(PIPELINE.max_seq_of, top_params)
            if batch.fragments:
                parts.execute(PIPELINE.partials_of, frag_pairs)
        return Probe(
            steps={r.step: state_of(r) for r in locked.fetchall()},
            new_frags=_keys(frags, batch.fragments),
            new_commits=_keys(commits, batch.commits),
            declared={(s, r): n for s, r, n in declared.fetchall() if (s, r) in pairs},
            top_seq=_tops(tops, batch.commits),
            partials=_partials(parts, batch),
        )

    def finish(
        self,
        conn: Connection,
        run_id: int,
        rows: Sequence[StepState],
        savepoint: str | None,
        partials: Sequence[PartialRow] = (),
    ) -> None:
        """Write the changed step rows (and the values of those finalised) and commit
        (``savepoint`` None: the transaction is durable when this returns; the caller's
        own commit then has nothing left to do) or release ``savepoint`` (inside a
        group), in one round trip."""
        driver = conn.connection.driver_connection
        assert driver is not None
        params = [_step_params(run_id, r) for r in rows if r.changed]
        values = pending_values(rows)
        write_breaches(conn, self.sql, run_id, rows)
        with driver.pipeline():
            if partials:
                driver.execute(PIPELINE.upsert_partials, _partial_params(run_id, partials))
            if params:
                driver.cursor().executemany(PIPELINE.update_steps, params)
            if values:
                driver.execute(PIPELINE.upsert_values, _values_params(run_id, values))
            if savepoint is None:
                driver.commit()
            else:
                driver.execute(f"RELEASE SAVEPOINT {savepoint}")

    def lock_group(
        self, conn: Connection, batches: Sequence[tuple[RunRecord, PreparedBatch, float]]
    ) -> bool:
        """Create and lock, up front and in (run, step) order, every step row a group of
        batches will touch, so that groups of several replicas never deadlock (a group
        otherwise takes its batches' locks in arrival order)."""
        wanted: dict[int, tuple[RunRecord, set[int], float]] = {}
        for run, batch, now in batches:
            _, steps, first = wanted.setdefault(run.id, (run, set(), now))
            steps.update(batch.steps())
            wanted[run.id] = (run, steps, min(first, now))
        driver = conn.connection.driver_connection
        assert driver is not None
        with driver.pipeline():
            for run_id in sorted(wanted):
                run, steps, now = wanted[run_id]
                driver.execute(PIPELINE.lock_steps, _lock_params(run, sorted(steps), now))
        return True

    def drop_empty_steps(self, conn: Connection, run_id: int, steps: Sequence[int]) -> None:
        """Delete the open step rows of ``steps`` that nothing was stored for: rows that
        :meth:`lock_group` created for batches that then failed."""
        conn.exec_driver_sql(
            PIPELINE.drop_empty_steps,
            {"run": run_id, "steps": list(steps), "open": StepStatus.OPEN.value},
        )

    def downsample(
        self, conn: Connection, params: dict[str, Any], in_range: list[Any]
    ) -> tuple[Sequence[Any], int]:
        return sql_series.downsampled_pg(conn, params, in_range)


def _copy_fragments(driver: Any, run: RunRecord, batch: PreparedBatch) -> None:
    """A large batch's fragments into the session's copy table, by binary ``COPY``."""
    driver.execute(PIPELINE.copy_table)
    with driver.cursor().copy(PIPELINE.copy_fragments) as copy:
        copy.set_types([t.lower() for t in PIPELINE.copy_types])
        for (s, r, q), (values, present, tails) in batch.fragments.items():
            copy.write_row((run.id, s, r, q, values, present, tails))


def _partials(cursor: Any, batch: PreparedBatch) -> dict[CommitKey, tuple[int, bytes]]:
    if not batch.fragments:
        return {}
    pairs = {k[:2] for k in batch.fragments}
    return {(s, r): (n, bytes(st)) for s, r, n, st in cursor.fetchall() if (s, r) in pairs}


def _partial_params(run_id: int, rows: Sequence[PartialRow]) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "step": [s for s, _, _, _ in rows],
        "rank": [r for _, r, _, _ in rows],
        "fragments": [n for _, _, n, _ in rows],
        "state": [st for _, _, _, st in rows],
    }


def _keys(cursor: Any, wanted: Any) -> list[Any]:
    return [tuple(k) for k in cursor.fetchall()] if wanted else []


def _tops(cursor: Any, commits: dict[CommitKey, int]) -> dict[CommitKey, int]:
    if not commits:
        return {}
    return {(s, r): top for s, r, top in cursor.fetchall() if (s, r) in commits}


def _lock_params(run: RunRecord, steps: list[int], now: float) -> dict[str, Any]:
    """A new step's columns (every step alike but for its number) and the steps."""
    out = new_row(run, 0, now)
    del out["step"]
    out["steps"] = steps
    return out


def _fragment_params(run: RunRecord, batch: PreparedBatch) -> dict[str, Any]:
    keys = list(batch.fragments)
    cells = batch.fragments.values()
    return {
        "run_id": run.id,
        "step": [k[0] for k in keys],
        "rank": [k[1] for k in keys],
        "seq": [k[2] for k in keys],
        "values_f64": [v for v, _, _ in cells],
        "present": [p for _, p, _ in cells],
        "tails": [t for _, _, t in cells],
    }


def _commit_params(run: RunRecord, batch: PreparedBatch) -> dict[str, Any]:
    return {
        "run_id": run.id,
        "step": [k[0] for k in batch.commits],
        "rank": [k[1] for k in batch.commits],
        "fragments": list(batch.commits.values()),
    }


def _values_params(run_id: int, values: Sequence[tuple[int, StoredValue]]) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "col": [c for _, (c, _, _) in values],
        "step": [s for s, _ in values],
        "value": [v for _, (_, v, _) in values],
        "state": [st for _, (_, _, st) in values],
    }


def _step_params(run_id: int, row: StepState) -> dict[str, Any]:
    out: dict[str, Any] = {c: getattr(row, c) for c in STEP_FIELDS}
    out["status"] = StepStatus(out["status"]).value
    out["run"], out["step"] = run_id, row.step
    return out
