"""PostgreSQL's dialect: the ingest hot path's statements, pipelined.

Writers run side by side here, so what they must not do at once is decided by
locks, taken in one order so that no two writers ever wait on each other in a circle:

* a batch first takes a transaction-level advisory lock per (step, rank) pair
  (:func:`~.sql_statement.pair_lock_key`), in key order: two writers of one pair take
  turns, writers of different ranks of one step never wait on each other;
* the step rows are read unlocked; a batch adds to its steps' counters with one
  statement (:data:`~.sql_statement.PIPELINE` ``apply``), which locks the rows
  in step order, and commits in the same round trip, so a step's row is locked only
  while its counters change and its transaction commits;
* a step the batch completed (or changed after a partial finalisation) is finalised
  afterwards in a transaction of its own that locks its row (the same as the sweeper's),
  so every finalisation sees every batch counted before it; except where the event
  loop's group completes a step every other pair of which the loop stored itself
  (:mod:`.pg_loop`): that step is finalised before the group is sent and written in
  its transaction, which fails unless the step's row counts exactly those pairs.

A batch of which nothing is stored yet (no commit or partial row of any of its pairs)
and none of whose steps is finalised — what a reporter sends, each rank each step
once — takes ONE round trip (:meth:`PostgresDialect.store_fresh`): lock the pairs, then
one statement that checks that and, only if it holds, makes every write of the apply,
then the commit. Anything else (a retry, a duplicate, a late rank of a partial step)
finds it does not hold, with nothing written, and takes the two round trips below.

Otherwise a batch takes two round trips: the probe (lock the pairs, read the steps, insert the
fragments and commits, read back the commits, top sequence numbers and partial rows of
its pairs) and the apply (write the partial rows, add to the counters, commit). Each
statement runs on its own, in order, with its own snapshot (READ COMMITTED), so the
reads see everything committed before the pairs' locks were granted and this
transaction's own inserts.

A batch of :data:`COPY_MIN_ROWS` fragments or more sends them by binary ``COPY``
before the pipeline (a ``COPY`` cannot run inside one), into a table of the session
that the pipeline's ``INSERT ... SELECT`` empties.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import psycopg
from sqlalchemy import Connection, Select
from sqlalchemy.dialects import postgresql

from steptally.service.domain.batch import CommitKey, PreparedBatch
from steptally.service.domain.finalise import StoredValue
from steptally.service.domain.packing import unbundled
from steptally.service.domain.progress import StepStatus
from steptally.service.domain.run import RunRecord
from steptally.service.domain.step import Delta, Probe, StepState, probe_from
from steptally.service.store import pg_pipeline, sql_series
from steptally.service.store.pg_arrays import Int8Array, byteas, float8s, int2s, int4s, int8s
from steptally.service.store.sql_run import read_run_key
from steptally.service.store.sql_statement import (
    PIPELINE,
    REFUSED_CHANGED,
    REFUSED_FINALISED,
    STEP_FIELDS,
    core,
    pair_lock_key,
    pairs_params,
)
from steptally.service.store.sql_step import (
    Locked,
    PartialRow,
    RunKey,
    StepParts,
    fragment_rows,
    new_row,
    pending_values,
    state_of_tuple,
    write_breaches,
)

#: a batch (or a merged group) of at least this many fragments is copied (binary
#: ``COPY`` into a session table, then one ``INSERT ... SELECT``) rather than sent as
#: arrays: the insert alone takes 0.55x the time at 4096 rows, but the copy costs two
#: round trips of its own, and at 512 rows end to end it gained nothing (bench/README.md)
COPY_MIN_ROWS = 2048
#: the statuses of a finalised step (a batch of which nothing is stored joins one only
#: through the probe and the apply)
FINALISED = [s.value for s in StepStatus if s is not StepStatus.OPEN]
#: the channel on which a finalisation is announced to the service's other processes
#: (``PostgresDialect.notify``; :mod:`steptally.service.coordination.pg_wake` listens)
FINALISED_CHANNEL = "steptally_finalised"
NOTIFY_FINALISED = f"SELECT pg_notify('{FINALISED_CHANNEL}', %(run)b::TEXT)"
#: what the plain fresh write fails with, writing nothing, where its batch is not new:
#: a pair stored (its commits or partials row's key broken) or a step finalised
#: (``steptally_refuse``, migration 0011)
NOT_FRESH = frozenset({"23505", "ST001"})


class PostgresDialect:
    """PostgreSQL: advisory locks on (step, rank) pairs, a batch in two pipelined round
    trips, a step's row locked only by the statement that adds to its counters."""

    name = "postgresql"
    sql = core(postgresql.insert)
    default_group = 64
    default_writers = 2
    finalises_after_commit = True
    #: announce each finalisation on :data:`FINALISED_CHANNEL`, delivered with its
    #: commit: where several processes serve one database without Redis, so that their
    #: event streams hear of each other's finalisations at once (the store's setting)
    notify = False

    def writer_lock(self) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()  # writers meet on the pairs and rows they lock

    def writer_connection(self, conn: Connection) -> Connection:
        """A writer's connection plans each prepared statement once, and never a
        sequential scan. Left to choose, PostgreSQL planned the pipeline's statements
        anew at every execution (a plan for the actual arrays always looked cheaper than
        the generic one): a fifth of its CPU a body at 256 ranks (bench/README.md,
        Scale). Its statements are key lookups, written so that a plan made for any
        parameters is one too; and a plan made while a run's tables were small (a
        sequential scan is cheapest then) would otherwise read the whole table for every
        pair as they grow — measured at 4096 ranks: 14 ms of database CPU a batch
        instead of 0.6."""
        driver = conn.connection.driver_connection
        assert isinstance(driver, psycopg.Connection)
        self.writer_settings(driver)
        return conn

    def writer_settings(self, driver: psycopg.Connection[Any]) -> None:
        """Set a writer's driver connection up (:meth:`writer_connection`)."""
        driver.execute("SET enable_seqscan = off")
        driver.execute("SET plan_cache_mode = force_generic_plan")
        driver.commit()

    def sync(self) -> None:
        pass  # a COMMIT returns once it is durable

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
        """Lock the batch's pairs, then read its steps and, in one statement, its pairs'
        commits, partial rows and fragment keys: one round trip (:func:`.pg_pipeline.run`,
        the transaction left open). With ``savepoint``, the pipeline opens that savepoint
        first. The steps' read is planned for its arrays each time, never prepared: a
        plan made once, for any steps, may read the run's steps through another index of
        theirs."""
        driver = conn.connection.driver_connection
        assert driver is not None
        pairs = batch.pairs()
        statements: list[tuple[str, Mapping[str, Any]]] = [
            (PIPELINE.lock_pairs, {"keys": _lock_keys(run.id, pairs)}),
            (PIPELINE.steps_of, {"run": run.id, "steps": int8s(sorted(batch.steps()))}),
            (PIPELINE.pairs_of, pairs_params(run.id, pairs)),
        ]
        plan_each = {PIPELINE.steps_of}
        if savepoint is not None:
            statements.insert(0, (f"SAVEPOINT {savepoint}", {}))
            plan_each.add(statements[0][0])
        *_, step_rows, found = pg_pipeline.run(
            driver, statements, commit=False, binary=True, plan_each=plan_each
        )
        stored: set[tuple[int, int, int]] = set()
        commits: dict[CommitKey, int] = {}
        parts: dict[CommitKey, tuple[int, bytes]] = {}
        for s, r, declared, n, state, keys, bundles in found:
            if declared is not None:
                commits[(s, r)] = declared
            if state is not None:
                parts[(s, r)] = (n, bytes(state))
            for key, seqs in zip(keys or (), bundles or (), strict=True):
                stored.update((s, r, q) for q, _ in unbundled(key, b"", None, None, seqs))
        steps = {r[1]: state_of_tuple(r) for r in step_rows}
        return probe_from(run, batch, now, steps, stored, commits, parts)

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
        """Insert the new fragments and commits, write the partial rows, add to the
        steps' counters (creating new steps): one statement (:data:`PIPELINE` ``apply``)
        and, ``alone``, the commit in the same round trip (a ``COPY`` before it for a
        large batch); the steps' rows are locked from that statement to the commit."""
        driver = conn.connection.driver_connection
        assert driver is not None
        rows = fragment_rows(run.id, batch, found.new_frags)
        copied = len(rows) >= COPY_MIN_ROWS
        if copied:
            _copy_fragments(driver, rows)
        params = {
            **_fragment_params(run.id, [] if copied else rows),
            **_commit_params(batch, found.new_commits),
            **_partial_params(partials),
            **_added_params(run, added, now),
        }
        [steps] = pg_pipeline.run(driver, [(PIPELINE.apply, params)], commit=alone)
        out = [state_of_tuple(r) for r in steps]
        for row in out:
            row.changed = True
        return out

    def store_fresh(
        self,
        conn: Connection,
        run: RunRecord,
        batch: PreparedBatch,
        added: Mapping[int, Delta],
        partials: Sequence[PartialRow],
        now: float,
    ) -> list[StepState] | None:
        """Store ``batch`` whole in ONE round trip, if nothing of its pairs is stored
        and none of its steps is finalised: lock its pairs, then one statement
        (:data:`PIPELINE` ``fresh``) that checks both and, only if they hold, makes
        every write of :meth:`apply` (its fragments, commits and partial rows all new,
        ``added`` to the steps), then the commit. A batch of plain pairs (what a
        reporter sends) is written by ``fresh_plain`` instead, which looks nothing up
        and fails where they do not hold (:data:`NOT_FRESH`), its transaction rolled
        back. Returns the steps as :meth:`apply` does, or None when they did not hold:
        nothing written, the transaction over. A batch large enough to be copied is
        left to :meth:`probe` and :meth:`apply`.

        The transaction goes through libpq (:func:`.pg_pipeline.run`), each statement
        prepared once a connection: through psycopg's pipeline it cost the writer
        ~0.2 ms more CPU a group (bench/README.md, Scale)."""
        driver = conn.connection.driver_connection
        assert driver is not None
        if batch.is_plain():
            statements = self.plain_statements(run, batch, added, partials, now)
            if statements is None:
                return None
            try:
                [found] = pg_pipeline.run(driver, statements, implicit=True)
            except psycopg.Error as exc:  # rolled back: nothing written
                if exc.sqlstate in NOT_FRESH:
                    return None
                raise
            return changed_steps(found)
        params = _fresh_params(run, batch, added, partials, now)
        if params is None:
            return None
        pairs = sorted(batch.pairs())
        params |= {
            "k_step": int8s([s for s, _ in pairs]),
            "k_rank": int4s([r for _, r in pairs]),
            "finalised": FINALISED,
        }
        lock = (PIPELINE.lock_pairs, {"keys": _lock_keys(run.id, pairs)})
        _, found = pg_pipeline.run(driver, [lock, (PIPELINE.fresh, params)])
        if not found[0][0]:  # ok
            return None
        return changed_steps(found)

    def plain_statements(
        self,
        run: RunRecord,
        batch: PreparedBatch,
        added: Mapping[int, Delta],
        partials: Sequence[PartialRow],
        now: float,
        finalised: Sequence[StepState] = (),
        run_key: RunKey | None = None,
    ) -> list[tuple[str, dict[str, Any]]] | None:
        """The transaction that writes ``batch`` (its pairs all plain) in one statement,
        as :meth:`store_fresh` sends it: ``fresh_plain``, which takes its pairs' locks
        (:data:`NOT_FRESH`: what it fails with where its batch is not new); None for a
        batch large enough to be copied. With ``finalised`` (the steps it completes on
        its own, finalised before it is sent: :func:`~.sql_ingest.finalise_fresh`, the
        run as its ``run_key`` says), their finalisation follows in the same
        transaction: each step's row (``finalise_fresh``, which fails unless the row and
        the run are as the finalisation took them) and their values; a finalisation
        after the commit would take a transaction, a commit's sync and two round trips
        more (bench/README.md, Scale, stop 18)."""
        params = _fresh_params(run, batch, added, partials, now)
        if params is None:
            return None
        params |= {
            "open": StepStatus.OPEN.value,
            "refused": REFUSED_FINALISED,
            "keys": _lock_keys(run.id, batch.pairs()),
        }
        statements = [(PIPELINE.fresh_plain, params)]
        if finalised:
            assert run_key is not None, "a finalisation inside the group needs the run's key"
            spec, world_size, step_timeout_s, columns = run_key
            same = {
                "open": StepStatus.OPEN.value,
                "spec": spec,
                "world_size": world_size,
                "step_timeout_s": step_timeout_s,
                "columns": columns,
                "refused": REFUSED_CHANGED,
            }
            statements += [
                (PIPELINE.finalise_fresh, p | same | {"first_seen_at": row.first_seen_at})
                for p, row in zip(_steps_params(run.id, finalised), finalised, strict=True)
            ]
            values = pending_values(finalised)
            assert not values.revised, "a step finalised inside its group is at revision 1"
            statements.append((PIPELINE.insert_values, _values_params(run.id, values.first)))
            if self.notify:
                statements.append((NOTIFY_FINALISED, {"run": str(run.id)}))
        return statements

    def write_steps(
        self, conn: Connection, run_id: int, rows: Sequence[StepState], last: bool = False
    ) -> None:
        """The values (a statement of arrays: :data:`PIPELINE` ``insert_values`` for steps
        finalised for the first time, ``upsert_values`` for the others) and
        the step rows (``update_step`` each, by its key) in one round trip
        (:func:`.pg_pipeline.run`; ``last``: with the ``COMMIT``, else the transaction
        left open); the breaches, when there are some, before. SQLAlchemy's executemany
        sent a statement a value, each row's parameters dumped in Python (half a
        finalisation's CPU at 8 ranks), and the values and the rows took a round trip
        each; the commit after them took one more."""
        write_breaches(conn, self.sql, run_id, rows)
        changed = [r for r in rows if r.changed]
        if not changed:
            return
        driver = conn.connection.driver_connection
        assert driver is not None
        first, revised = pending_values(changed)
        statements = [
            (text, _values_params(run_id, values))
            for text, values in ((PIPELINE.insert_values, first), (PIPELINE.upsert_values, revised))
            if values
        ]
        statements += [(PIPELINE.update_step, p) for p in _steps_params(run_id, changed)]
        if self.notify and any(r.status is not StepStatus.OPEN for r in changed):
            statements.append((NOTIFY_FINALISED, {"run": str(run_id)}))
        pg_pipeline.run(driver, statements, commit=last)

    def read_parts(self, conn: Connection, run_id: int, step: int) -> StepParts:
        """A step's partial rows and commits in one round trip (:func:`.pg_pipeline.run`,
        the transaction left open), as binary: read as
        text, each state came hex-encoded, twice its size, and was decoded back (at 256
        ranks, 1.9 ms a finalisation for the partial rows alone against 0.9)."""
        driver = conn.connection.driver_connection
        assert driver is not None
        params = {"run": run_id, "step": step}
        reads = [(PIPELINE.partials_of_step, params), (PIPELINE.commits_of_step, params)]
        parts, commits = pg_pipeline.run(driver, reads, commit=False, binary=True)
        return parts, commits

    def run_key(self, conn: Connection, run_id: int) -> RunKey | None:
        return read_run_key(conn, run_id)

    def lock_steps(self, conn: Connection, run_id: int, steps: Sequence[int]) -> Locked:
        """Lock the rows of ``steps`` and read each one's parts (:meth:`read_parts`'s
        statements) and the run's key (:class:`~.sql_run.KnownRuns`) in the same round
        trip, after the lock: each read has its own snapshot, taken once the rows are
        locked, as when it came in a round trip of its own. A finalisation then takes
        two round trips less. The rows' read is planned for its steps each time, never
        prepared (``tests/integration/test_postgres_plans.py``)."""
        driver = conn.connection.driver_connection
        assert driver is not None
        ordered = sorted(steps)
        statements: list[tuple[str, dict[str, Any]]] = [
            (PIPELINE.locked_steps_of, {"run": run_id, "steps": int8s(ordered)})
        ]
        for step in ordered:
            params = {"run": run_id, "step": step}
            statements += [(PIPELINE.partials_of_step, params), (PIPELINE.commits_of_step, params)]
        statements.append((PIPELINE.run_key, {"run": run_id}))
        locked, *reads, key = pg_pipeline.run(
            driver, statements, commit=False, binary=True, plan_each={PIPELINE.locked_steps_of}
        )
        parts = {s: (reads[2 * i], reads[2 * i + 1]) for i, s in enumerate(ordered)}

        def read(conn: Connection, run_id_: int, step: int) -> StepParts:
            if run_id_ == run_id and step in parts:
                return parts.pop(step)
            return self.read_parts(conn, run_id_, step)

        return Locked([state_of_tuple(r) for r in locked], read, key[0] if key else None)

    def lock_group(
        self, conn: Connection, batches: Sequence[tuple[RunRecord, PreparedBatch, float]]
    ) -> None:
        """Lock every pair of a group up front, in one order (a group otherwise takes its
        batches' pairs in arrival order, and two groups could wait on each other)."""
        keys = sorted(
            {pair_lock_key(run.id, s, r) for run, batch, _ in batches for s, r in batch.pairs()}
        )
        driver = conn.connection.driver_connection
        assert driver is not None
        driver.execute(PIPELINE.lock_pairs, {"keys": int8s(keys)})

    def downsample(
        self, conn: Connection, params: dict[str, Any], in_range: list[Any]
    ) -> tuple[Sequence[Any], int]:
        return sql_series.downsampled_pg(conn, params, in_range)


def _fresh_params(
    run: RunRecord,
    batch: PreparedBatch,
    added: Mapping[int, Delta],
    partials: Sequence[PartialRow],
    now: float,
) -> dict[str, Any] | None:
    """A fresh write's rows as parameters: every fragment, commit and partial row of
    ``batch`` new, ``added`` to its steps; None for a batch large enough to be copied."""
    rows = fragment_rows(run.id, batch, list(batch.fragments))
    if len(rows) >= COPY_MIN_ROWS:
        return None
    return {
        **_fragment_params(run.id, rows),
        **_commit_params(batch, list(batch.commits)),
        **_partial_params(partials),
        **_added_params(run, added, now),
    }


def changed_steps(found: Sequence[tuple[Any, ...]]) -> list[StepState]:
    """The step rows a fresh write returned (after its ``ok``), each marked changed."""
    out = [state_of_tuple(r[1:]) for r in found]
    for row in out:
        row.changed = True
    return out


def _lock_keys(run_id: int, pairs: Iterable[CommitKey]) -> Int8Array:
    return int8s(sorted(pair_lock_key(run_id, s, r) for s, r in pairs))


def _added_params(run: RunRecord, added: Mapping[int, Delta], now: float) -> dict[str, Any]:
    """A new step's columns, and what each step of ``added`` gains, in step order."""
    out = new_row(run, 0, now)
    for column in ("step", "committed_ranks", "expected", "received", "missing_ranks"):
        del out[column]
    steps = sorted(added)
    out["world_size"] = run.world_size
    out["step"] = int8s(steps)
    out["received"] = int8s([added[s].received for s in steps])
    out["committed"] = int4s([added[s].committed for s in steps])
    out["expected"] = int8s([added[s].expected for s in steps])
    return out


def _copy_fragments(driver: Any, rows: Sequence[tuple[Any, ...]]) -> None:
    """A large batch's fragments rows, by binary ``COPY``."""
    with driver.cursor().copy(PIPELINE.copy_fragments) as copy:
        copy.set_types([t.lower() for t in PIPELINE.copy_types])
        for row in rows:
            copy.write_row(row)


def _values_params(run_id: int, values: Sequence[tuple[int, StoredValue]]) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "col": int4s([c for _, (c, _, _) in values]),
        "step": int8s([s for s, _ in values]),
        "value": float8s([v for _, (_, v, _) in values]),
        "state": int2s([st for _, (_, _, st) in values]),
    }


def _steps_params(run_id: int, rows: Sequence[StepState]) -> list[dict[str, Any]]:
    """Each row's key and columns of :data:`~.sql_statement.STEP_FIELDS`."""
    return [
        {
            "run_id": run_id,
            "step": r.step,
            **{name: getattr(r, name) for name in STEP_FIELDS},
            "status": r.status.value,
        }
        for r in rows
    ]


def _partial_params(rows: Sequence[PartialRow]) -> dict[str, Any]:
    return {
        "p_step": int8s([s for s, _, _, _ in rows]),
        "p_rank": int4s([r for _, r, _, _ in rows]),
        "p_fragments": int8s([n for _, _, n, _ in rows]),
        "p_state": byteas([st for _, _, _, st in rows]),
    }


def _fragment_params(run_id: int, rows: Sequence[tuple[Any, ...]]) -> dict[str, Any]:
    """:func:`~.sql_step.fragment_rows` as one array per column."""
    columns = list(zip(*rows, strict=True)) if rows else [()] * 8
    out: dict[str, Any] = {
        "f_step": int8s(columns[1]),
        "f_rank": int4s(columns[2]),
        "f_seq": int8s(columns[3]),
        "f_values_f64": byteas(columns[4]),
        "f_present": byteas(columns[5]),
        "f_tails": byteas(columns[6]),
        "f_seqs": byteas(columns[7]),
    }
    out["run_id"] = run_id
    return out


def _commit_params(batch: PreparedBatch, new: Sequence[CommitKey]) -> dict[str, Any]:
    return {
        "c_step": int8s([k[0] for k in new]),
        "c_rank": int4s([k[1] for k in new]),
        "c_fragments": int8s([batch.commits[k] for k in new]),
    }
