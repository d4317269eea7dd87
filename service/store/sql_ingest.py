"""One batch into SQL, all or nothing, in one transaction.

Order inside the transaction: lock (or create) the batch's step rows, which
serialises every writer of those steps; bulk-insert fragments and commits with
``ON CONFLICT DO NOTHING RETURNING``; read back the commits and top sequence
numbers the checks need (the *probe*); classify only the keys that collided
(duplicate or conflict); check declared counts against sequence numbers; update the
step counters; finalise what is now complete, or what changed after a partial
finalisation. Any error raises and rolls everything back.

The probe and the final write are the only dialect-specific parts: on PostgreSQL
they are pipelined (:mod:`.sql_postgres`), elsewhere they are plain statements.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sqlalchemy import Connection

from steptally.service.domain.batch import CommitKey, FragmentKey, PreparedBatch
from steptally.service.domain.cells import Cell
from steptally.service.domain.progress import StepStatus, is_complete
from steptally.service.domain.run import RunRecord
from steptally.service.errors import CommitConflict, FragmentConflict, StepComplete
from steptally.service.store import sql_postgres
from steptally.service.store.base import FinalisedStep, IngestOutcome
from steptally.service.store.sql_statement import Statements, keys_params, statements
from steptally.service.store.sql_step import Probe, StepRow, finalise_row, lock_steps, write_steps

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
    if len(new_frags) < len(batch.fragments):
        _classify_fragments(conn, sql, run, batch, set(batch.fragments) - set(new_frags))
    for key in new_frags:
        if steps[key[0]].status is StepStatus.COMPLETE:
            raise StepComplete(
                f"step {key[0]} is complete; rank {key[1]} cannot add fragment {key[2]} to it",
                batch.where(key),
            )
    _check_commit_collisions(batch, found)
    _check_fragments(batch, found)
    _check_commits(batch, found)
    _count(steps, new_frags, {k: batch.commits[k] for k in found.new_commits})
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


def _classify_fragments(
    conn: Connection,
    sql: Statements,
    run: RunRecord,
    batch: PreparedBatch,
    collided: set[FragmentKey],
) -> None:
    rows = conn.execute(sql.fragments_of, keys_params(run.id, collided))
    for s, r, q, values, present, tails in rows:
        key = (s, r, q)
        stored = (bytes(values), _bytes(present), _bytes(tails))
        if key in collided and batch.fragments[key] != stored:
            raise FragmentConflict(
                f"fragment step {s} rank {r} seq {q} was already received with different "
                "values; a fragment's values never change, so send a new seq or fix the sender",
                batch.where(key),
            )


def _bytes(b: bytes | None) -> bytes | None:
    return None if b is None else bytes(b)


def _check_commit_collisions(batch: PreparedBatch, found: Probe) -> None:
    """A commit already stored must declare the same count again."""
    fresh = set(found.new_commits)
    for key, n in batch.commits.items():
        stored = found.declared.get(key)
        if key not in fresh and stored is not None and stored != n:
            s, r = key
            raise CommitConflict(
                f"rank {r} already committed step {s} with {stored} fragments, not "
                f"{n}; a commit is final",
                batch.commit_where(key),
            )


def _check_fragments(batch: PreparedBatch, found: Probe) -> None:
    """A new fragment of a committed rank must have ``seq`` below the declared count."""
    for s, r, q in found.new_frags:
        n = found.declared.get((s, r))
        if n is not None and q >= n:
            raise CommitConflict(
                f"rank {r} committed step {s} with {n} fragments, so seq {q} cannot exist; "
                "seq counts from 0 to fragments-1",
                batch.where((s, r, q)),
            )


def _check_commits(batch: PreparedBatch, found: Probe) -> None:
    """A new commit must count every fragment its rank sent (fragments of this batch
    were inserted before the probe read the top sequence numbers)."""
    for key in found.new_commits:
        top, n = found.top_seq.get(key), batch.commits[key]
        if top is not None and top >= n:
            s, r = key
            raise CommitConflict(
                f"rank {r} commits step {s} with {n} fragments, but fragment seq {top} "
                "arrived; count every fragment sent",
                batch.commit_where(key),
            )


def _count(
    steps: dict[int, StepRow], new_frags: list[FragmentKey], new_commits: dict[CommitKey, int]
) -> None:
    for s, n in Counter(k[0] for k in new_frags).items():
        steps[s].received += n
        steps[s].changed = True
    per_step: defaultdict[int, list[int]] = defaultdict(list)
    for (s, _), n in new_commits.items():
        per_step[s].append(n)
    for s, counts in per_step.items():
        row = steps[s]
        row.committed_ranks += len(counts)
        row.expected += sum(counts)
        row.missing_ranks -= len(counts)
        row.changed = True


def _finalise(
    conn: Connection,
    run: RunRecord,
    reload: Callable[[], RunRecord],
    rows: Iterable[StepRow],
    now: float,
) -> list[FinalisedStep]:
    out = []
    current: RunRecord | None = None
    for row in rows:
        if not row.changed:
            continue
        done = is_complete(run.world_size, row.committed_ranks, row.received, row.expected)
        status: StepStatus | None
        if done and row.status is not StepStatus.COMPLETE:
            status = StepStatus.COMPLETE
        elif row.status is StepStatus.PARTIAL:
            status = None  # partial again, or complete if this made it so
        else:
            continue
        current = current or reload()
        out.append(finalise_row(conn, current, row, status, now))
    return out
