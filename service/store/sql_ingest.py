"""One batch into SQL, all or nothing, in one transaction.

Order inside the transaction: lock (or create) the batch's step rows, which
serialises every writer of those steps; bulk-insert fragments and commits with
``ON CONFLICT DO NOTHING RETURNING``; classify only the keys that collided
(duplicate or conflict); check declared counts against sequence numbers; update the
step counters; finalise what is now complete, or what changed after a partial
finalisation. Any error raises and rolls everything back.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable

from sqlalchemy import Connection

from steptally.service.domain.batch import CommitKey, FragmentKey, PreparedBatch
from steptally.service.domain.progress import StepStatus, is_complete
from steptally.service.domain.run import RunRecord
from steptally.service.errors import CommitConflict, FragmentConflict, StepComplete
from steptally.service.store.base import FinalisedStep, IngestOutcome
from steptally.service.store.sql_statement import Statements, keys_params, statements
from steptally.service.store.sql_step import StepRow, finalise_row, lock_steps, write_steps


def ingest(
    conn: Connection,
    run: RunRecord,
    batch: PreparedBatch,
    now: float,
    reload: Callable[[], RunRecord],
) -> IngestOutcome:
    """Store ``batch``; ``reload`` reads the run's current spec when a step is finalised."""
    sql = statements(conn.dialect.name)
    steps = lock_steps(conn, run, batch.steps(), now)
    new_frags = _insert_fragments(conn, sql, run, batch)
    for key in new_frags:
        if steps[key[0]].status is StepStatus.COMPLETE:
            raise StepComplete(
                f"step {key[0]} is complete; rank {key[1]} cannot add fragment {key[2]} to it",
                batch.where(key),
            )
    new_commits = _insert_commits(conn, sql, run, batch)
    _check_fragments(conn, sql, run, batch, new_frags, set(new_commits), steps)
    _check_commits(conn, sql, run, batch, new_commits, steps)
    _count(steps, new_frags, {k: batch.commits[k] for k in new_commits})
    finalised = _finalise(conn, run, reload, steps.values(), now)
    write_steps(conn, run.id, list(steps.values()))
    return IngestOutcome(
        accepted=len(new_frags),
        duplicates=len(batch.fragments) - len(new_frags),
        commits=len(new_commits),
        finalised=finalised,
    )


def _insert_fragments(
    conn: Connection, sql: Statements, run: RunRecord, batch: PreparedBatch
) -> list[FragmentKey]:
    if not batch.fragments:
        return []
    params = [
        {"run_id": run.id, "step": s, "rank": r, "seq": q, "values_f64": v, "present": p}
        for (s, r, q), (v, p) in batch.fragments.items()
    ]
    inserted = [(s, r, q) for s, r, q in conn.execute(sql.insert_fragments, params)]
    if len(inserted) < len(params):
        _classify_fragments(conn, sql, run, batch, set(batch.fragments) - set(inserted))
    return inserted


def _classify_fragments(
    conn: Connection,
    sql: Statements,
    run: RunRecord,
    batch: PreparedBatch,
    collided: set[FragmentKey],
) -> None:
    for s, r, q, values, present in conn.execute(sql.fragments_of, keys_params(run.id, collided)):
        key = (s, r, q)
        if key in collided and batch.fragments[key] != (bytes(values), _bytes(present)):
            raise FragmentConflict(
                f"fragment step {s} rank {r} seq {q} was already received with different "
                "values; a fragment's values never change, so send a new seq or fix the sender",
                batch.where(key),
            )


def _bytes(b: bytes | None) -> bytes | None:
    return None if b is None else bytes(b)


def _insert_commits(
    conn: Connection, sql: Statements, run: RunRecord, batch: PreparedBatch
) -> list[CommitKey]:
    if not batch.commits:
        return []
    params = [
        {"run_id": run.id, "step": s, "rank": r, "fragments": n}
        for (s, r), n in batch.commits.items()
    ]
    inserted = [(s, r) for s, r in conn.execute(sql.insert_commits, params)]
    if len(inserted) < len(params):
        collided = set(batch.commits) - set(inserted)
        for s, r, n in conn.execute(sql.commits_of, keys_params(run.id, collided)):
            if (s, r) in collided and batch.commits[(s, r)] != n:
                raise CommitConflict(
                    f"rank {r} already committed step {s} with {n} fragments, not "
                    f"{batch.commits[(s, r)]}; a commit is final",
                    _commit_where(batch, (s, r)),
                )
    return inserted


def _commit_where(batch: PreparedBatch, key: CommitKey) -> str:
    return f"commits[{list(batch.commits).index(key)}]"


def _check_fragments(
    conn: Connection,
    sql: Statements,
    run: RunRecord,
    batch: PreparedBatch,
    new_frags: list[FragmentKey],
    new_commits: set[CommitKey],
    steps: dict[int, StepRow],
) -> None:
    """A new fragment of a committed rank must have ``seq`` below the declared count."""
    declared = {k: batch.commits[k] for k in new_commits}
    # a pair committed in this batch had no commit before; others may, if the step has any
    earlier = {
        (s, r) for s, r, _ in new_frags if (s, r) not in new_commits and steps[s].committed_ranks
    }
    if earlier:
        for s, r, n in conn.execute(sql.commits_of, keys_params(run.id, earlier)):
            declared[(s, r)] = n
    for s, r, q in new_frags:
        n = declared.get((s, r))
        if n is not None and q >= n:
            raise CommitConflict(
                f"rank {r} committed step {s} with {n} fragments, so seq {q} cannot exist; "
                "seq counts from 0 to fragments-1",
                batch.where((s, r, q)),
            )


def _check_commits(
    conn: Connection,
    sql: Statements,
    run: RunRecord,
    batch: PreparedBatch,
    new_commits: list[CommitKey],
    steps: dict[int, StepRow],
) -> None:
    """A new commit must count every fragment its rank sent (fragments of this batch
    are already inserted, so one query sees them all)."""
    if not new_commits:
        return
    wanted = set(new_commits)
    for s, r, top in conn.execute(sql.max_seq_of, keys_params(run.id, wanted)):
        n = batch.commits.get((s, r))
        if (s, r) in wanted and n is not None and top >= n:
            raise CommitConflict(
                f"rank {r} commits step {s} with {n} fragments, but fragment seq {top} "
                "arrived; count every fragment sent",
                _commit_where(batch, (s, r)),
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
