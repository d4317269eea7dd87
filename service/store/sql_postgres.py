"""The ingest hot path on PostgreSQL: the same statements, pipelined.

A batch's transaction holds its steps' row locks from the first statement to the
commit, so every round trip inside it is time that other writers of the step wait.
Here the statements that do not depend on each other's answers travel together in
one psycopg pipeline, in the order the generic path runs them (lock the steps,
insert fragments and commits, read back what the checks need), and the step rows'
update travels with the ``COMMIT``: two round trips under the lock instead of six.

Each statement still runs on its own, in order, with its own snapshot (READ
COMMITTED), so the reads see everything committed before the lock was granted and
this transaction's own inserts. Arrays (``unnest``, ``= ANY``) keep every statement's
text fixed whatever the batch size, so psycopg prepares each once per connection.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from psycopg.rows import namedtuple_row
from sqlalchemy import Connection

from steptally.service.domain.batch import CommitKey, FragmentKey, PreparedBatch
from steptally.service.domain.progress import StepStatus
from steptally.service.domain.run import RunRecord
from steptally.service.domain.step import Probe, StepState
from steptally.service.store.sql_statement import STEP_FIELDS
from steptally.service.store.sql_step import pending_values, state_of
from steptally.service.store.sql_values import UPSERT_VALUES_PG, pg_params

_STEP_COLUMNS = (
    "run_id, step, status, revision, committed_ranks, expected, received, missing_ranks, "
    "first_seen_at, deadline, finalised_at, result"
)
LOCK_STEPS = (
    f"INSERT INTO steps ({_STEP_COLUMNS}) "
    "SELECT %(run)s, s, 'open', 0, 0, 0, 0, %(world)s, %(now)s, %(deadline)s, NULL, NULL "
    "FROM unnest(%(steps)s::bigint[]) AS s "
    "ON CONFLICT (run_id, step) DO UPDATE SET status = steps.status "
    f"RETURNING {_STEP_COLUMNS}"
)
INSERT_FRAGMENTS = (
    "INSERT INTO fragments (run_id, step, rank, seq, values_f64, present, tails) "
    "SELECT %(run)s, * FROM unnest("
    "%(steps)s::bigint[], %(ranks)s::int[], %(seqs)s::bigint[], %(values)s::bytea[], "
    "%(present)s::bytea[], %(tails)s::bytea[]) "
    "ON CONFLICT DO NOTHING RETURNING step, rank, seq"
)
INSERT_COMMITS = (
    "INSERT INTO commits (run_id, step, rank, fragments) "
    "SELECT %(run)s, * FROM unnest(%(steps)s::bigint[], %(ranks)s::int[], %(counts)s::bigint[]) "
    "ON CONFLICT DO NOTHING RETURNING step, rank"
)
COMMITS_OF = (
    "SELECT step, rank, fragments FROM commits "
    "WHERE run_id = %(run)s AND step = ANY(%(steps)s::bigint[]) AND rank = ANY(%(ranks)s::int[])"
)
MAX_SEQ_OF = (
    "SELECT step, rank, max(seq) FROM fragments "
    "WHERE run_id = %(run)s AND step = ANY(%(steps)s::bigint[]) AND rank = ANY(%(ranks)s::int[]) "
    "GROUP BY step, rank"
)
UPDATE_STEPS = "UPDATE steps SET {} WHERE run_id = %(run)s AND step = %(step)s".format(
    ", ".join(f"{c} = %({c})s" for c in STEP_FIELDS)
)


def probe(
    conn: Connection, run: RunRecord, batch: PreparedBatch, now: float, savepoint: str | None
) -> Probe:
    """Lock the batch's steps, insert its fragments and commits, and read back the
    commits and top sequence numbers of its (step, rank) pairs: one round trip.
    With ``savepoint``, the pipeline opens that savepoint first."""
    driver = conn.connection.driver_connection
    assert driver is not None
    steps = batch.steps()
    pairs = {k[:2] for k in batch.fragments} | set(batch.commits)
    lock_params = _lock_params(run, steps, now)
    frag_params = _fragment_params(run, batch) if batch.fragments else None
    commit_params = _commit_params(run, batch) if batch.commits else None
    pair_params = _pair_params(run, pairs)
    top_params = _pair_params(run, batch.commits) if batch.commits else None
    locked = driver.cursor(row_factory=namedtuple_row)
    frags, commits, declared, tops = (driver.cursor() for _ in range(4))
    with driver.pipeline():
        if savepoint is not None:
            driver.execute(f"SAVEPOINT {savepoint}")
        locked.execute(LOCK_STEPS, lock_params)
        if frag_params is not None:
            frags.execute(INSERT_FRAGMENTS, frag_params)
        if commit_params is not None:
            commits.execute(INSERT_COMMITS, commit_params)
        declared.execute(COMMITS_OF, pair_params)
        if top_params is not None:
            tops.execute(MAX_SEQ_OF, top_params)
    return Probe(
        steps={r.step: state_of(r) for r in locked.fetchall()},
        new_frags=_keys(frags, batch.fragments),
        new_commits=_keys(commits, batch.commits),
        declared={(s, r): n for s, r, n in declared.fetchall() if (s, r) in pairs},
        top_seq=_tops(tops, batch.commits),
    )


def _keys(cursor: Any, wanted: Any) -> list[Any]:
    return [tuple(k) for k in cursor.fetchall()] if wanted else []


def _tops(cursor: Any, commits: dict[CommitKey, int]) -> dict[CommitKey, int]:
    if not commits:
        return {}
    return {(s, r): top for s, r, top in cursor.fetchall() if (s, r) in commits}


def _lock_params(run: RunRecord, steps: list[int], now: float) -> dict[str, Any]:
    return {
        "run": run.id,
        "world": run.world_size,
        "now": now,
        "deadline": now + run.step_timeout_s,
        "steps": steps,
    }


def _fragment_params(run: RunRecord, batch: PreparedBatch) -> dict[str, Any]:
    keys: list[FragmentKey] = list(batch.fragments)
    cells = batch.fragments.values()
    return {
        "run": run.id,
        "steps": [k[0] for k in keys],
        "ranks": [k[1] for k in keys],
        "seqs": [k[2] for k in keys],
        "values": [v for v, _, _ in cells],
        "present": [p for _, p, _ in cells],
        "tails": [t for _, _, t in cells],
    }


def _commit_params(run: RunRecord, batch: PreparedBatch) -> dict[str, Any]:
    return {
        "run": run.id,
        "steps": [k[0] for k in batch.commits],
        "ranks": [k[1] for k in batch.commits],
        "counts": list(batch.commits.values()),
    }


def _pair_params(run: RunRecord, pairs: Any) -> dict[str, Any]:
    return {
        "run": run.id,
        "steps": sorted({p[0] for p in pairs}),
        "ranks": sorted({p[1] for p in pairs}),
    }


def write_and_finish(
    conn: Connection, run_id: int, rows: Sequence[StepState], savepoint: str | None
) -> None:
    """Write the changed step rows (and the values of those finalised) and commit
    (``savepoint`` None: the transaction is durable when this returns; the caller's own
    commit then has nothing left to do) or release ``savepoint`` (inside a group), in
    one round trip."""
    driver = conn.connection.driver_connection
    assert driver is not None
    params = [_step_params(run_id, r) for r in rows if r.changed]
    values = pending_values(rows)
    with driver.pipeline():
        if params:
            driver.cursor().executemany(UPDATE_STEPS, params)
        if values:
            driver.execute(UPSERT_VALUES_PG, pg_params(run_id, values))
        if savepoint is None:
            driver.commit()
        else:
            driver.execute(f"RELEASE SAVEPOINT {savepoint}")


def lock_group(conn: Connection, batches: Sequence[tuple[RunRecord, PreparedBatch, float]]) -> None:
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
            driver.execute(LOCK_STEPS, _lock_params(run, sorted(steps), now))


def drop_empty_steps(conn: Connection, run_id: int, steps: Sequence[int]) -> None:
    """Delete the open step rows of ``steps`` that nothing was stored for: rows that
    :func:`lock_group` created for batches that then failed."""
    conn.exec_driver_sql(
        "DELETE FROM steps WHERE run_id = %(run)s AND step = ANY(%(steps)s::bigint[]) "
        "AND status = 'open' AND committed_ranks = 0 AND received = 0",
        {"run": run_id, "steps": list(steps)},
    )


def _step_params(run_id: int, row: StepState) -> dict[str, Any]:
    out: dict[str, Any] = {c: getattr(row, c) for c in STEP_FIELDS}
    out["status"] = StepStatus(out["status"]).value
    out["run"], out["step"] = run_id, row.step
    return out
