"""One batch into SQL, all or nothing, in one transaction: fetching and writing
around the step rules of :mod:`steptally.service.domain.step`.

Order inside the transaction: lock (or create) the batch's step rows, which
serialises every writer of those steps; bulk-insert fragments and commits with
``ON CONFLICT DO NOTHING RETURNING``; read back the commits and top sequence
numbers the checks need (the *probe*); read the stored values of only the fragments
that collided, for the duplicate check; apply the commit checks; update the step
counters; finalise what is now complete, or what changed after a partial
finalisation. Any error raises and rolls everything back.

The probe and the final write are the only dialect-specific parts: on PostgreSQL
they are pipelined (:mod:`.sql_postgres`), elsewhere they are plain statements.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from sqlalchemy import Connection

from steptally.service.domain import step as rules
from steptally.service.domain.batch import CommitKey, FragmentKey, PreparedBatch
from steptally.service.domain.cells import Cell
from steptally.service.domain.run import RunRecord
from steptally.service.domain.step import Probe, StepState
from steptally.service.store import sql_postgres
from steptally.service.store.base import FinalisedStep, IngestOutcome
from steptally.service.store.sql_statement import Statements, keys_params, statements
from steptally.service.store.sql_step import finalise_row, lock_steps, write_steps

SAVEPOINT = "steptally_batch"


def ingest(
    conn: Connection,
    run: RunRecord,
    batch: PreparedBatch,
    now: float,
    reload: Callable[[], RunRecord],
    savepoint: bool = False,
) -> IngestOutcome:
    """Store ``batch``; ``reload`` reads the run's current spec when a step is finalised.

    Alone (``savepoint=False``) the batch is the whole transaction, and on PostgreSQL
    this commits it. In a group (``savepoint=True``) the batch runs inside its own
    savepoint, released at the end; if it raises, the transaction is rolled back to
    the savepoint (so nothing of the batch remains) and the error propagates.
    """
    if not savepoint:
        return _ingest(conn, run, batch, now, reload, False)
    postgres = conn.dialect.name == "postgresql"
    if not postgres:  # on PostgreSQL the savepoint travels in the probe's pipeline
        conn.exec_driver_sql(f"SAVEPOINT {SAVEPOINT}")
    try:
        return _ingest(conn, run, batch, now, reload, True)
    except Exception:
        conn.exec_driver_sql(f"ROLLBACK TO SAVEPOINT {SAVEPOINT}")
        conn.exec_driver_sql(f"RELEASE SAVEPOINT {SAVEPOINT}")
        raise


def _ingest(
    conn: Connection,
    run: RunRecord,
    batch: PreparedBatch,
    now: float,
    reload: Callable[[], RunRecord],
    grouped: bool,
) -> IngestOutcome:
    sql = statements(conn.dialect.name)
    postgres = conn.dialect.name == "postgresql"
    if postgres:
        found = sql_postgres.probe(conn, run, batch, now, SAVEPOINT if grouped else None)
    else:
        found = _probe(conn, run, batch, now)
    steps, new_frags = found.steps, found.new_frags
    collided = rules.duplicates(batch, found)
    if collided:
        rules.check_duplicates(batch, collided, _stored_fragments(conn, sql, run, collided))
    rules.check(batch, found)
    rules.count(steps, new_frags, {k: batch.commits[k] for k in found.new_commits})
    finalised = _finalise(conn, run, reload, steps.values(), now)
    rows = [*steps.values()]
    if postgres:
        sql_postgres.write_and_finish(conn, run.id, rows, SAVEPOINT if grouped else None)
    else:
        write_steps(conn, run.id, rows)
        if grouped:
            conn.exec_driver_sql(f"RELEASE SAVEPOINT {SAVEPOINT}")
    return IngestOutcome(
        accepted=len(new_frags),
        duplicates=len(batch.fragments) - len(new_frags),
        commits=len(found.new_commits),
        finalised=finalised,
    )


def _probe(conn: Connection, run: RunRecord, batch: PreparedBatch, now: float) -> Probe:
    """The probe as plain statements, reading only what the checks will use."""
    sql = statements(conn.dialect.name)
    steps = lock_steps(conn, run, batch.steps(), now)
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


def _stored_fragments(
    conn: Connection, sql: Statements, run: RunRecord, keys: set[FragmentKey]
) -> Iterator[rules.StoredFragment]:
    """The stored rows of (at least) the fragments ``keys``."""
    for s, r, q, values, present, tails in conn.execute(
        sql.fragments_of, keys_params(run.id, keys)
    ):
        yield s, r, q, bytes(values), _bytes(present), _bytes(tails)


def _bytes(b: bytes | None) -> bytes | None:
    return None if b is None else bytes(b)


def _finalise(
    conn: Connection,
    run: RunRecord,
    reload: Callable[[], RunRecord],
    rows: Iterable[StepState],
    now: float,
) -> list[FinalisedStep]:
    """Finalise the steps that :func:`~steptally.service.domain.step.next_status` names,
    against the run's current spec (read once, when the first one is finalised)."""
    out = []
    current: RunRecord | None = None
    for row in rows:
        status = rules.next_status(run.world_size, row)
        if status is None:
            continue
        current = current or reload()
        out.append(finalise_row(conn, current, row, status, now))
    return out
