"""One batch into SQL, all or nothing, in one transaction: fetching and writing
around the step rules of :mod:`steptally.service.domain.step`.

Order inside the transaction: lock (or create) the batch's step rows, which
serialises every writer of those steps; bulk-insert fragments and commits with
``ON CONFLICT DO NOTHING RETURNING``; read back the commits and top sequence
numbers the checks need (the *probe*); read the stored values of only the fragments
that collided, for the duplicate check; apply the commit checks; update the step
counters; merge the new fragments into their (step, rank) partial rows; finalise
what is now complete, or what changed after a partial finalisation. Any error
raises and rolls everything back.

The probe and the final write are the only dialect-specific parts: the store's
:class:`~steptally.service.store.dialect.Dialect` runs them (PostgreSQL pipelines
them), and this module only fetches and writes around the rules.

A group of batches (:mod:`.group_commit`) of one run whose (step, rank) pairs are
disjoint is stored by :func:`ingest_merged` with the statements of ONE batch: one
probe for all of them, then the rules of each batch in turn, in arrival order, over
what the probe found for its own keys, exactly as if each had run alone after the
ones before it. That holds while no batch's step is finalised before a later batch of
the group touches it; then, or when any batch breaks a rule, it raises
:class:`NotMerged` and the group is stored again one savepoint per batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from sqlalchemy import Connection

from steptally.service.domain import step as rules
from steptally.service.domain.batch import FragmentKey, PreparedBatch, merge
from steptally.service.domain.run import RunRecord
from steptally.service.domain.step import Probe, StepState
from steptally.service.store.dialect import Dialect
from steptally.service.store.protocol import FinalisedStep, IngestOutcome
from steptally.service.store.sql_statement import Statements, keys_params
from steptally.service.store.sql_step import (
    PartialRow,
    finalise_row,
    merged_partials,
    upsert_partials,
    write_partials,
)

SAVEPOINT = "steptally_batch"


def ingest(
    conn: Connection,
    dialect: Dialect,
    run: RunRecord,
    batch: PreparedBatch,
    now: float,
    reload: Callable[[], RunRecord],
    savepoint: bool = False,
) -> IngestOutcome:
    """Store ``batch``; ``reload`` reads the run's current spec when a step is finalised.

    Alone (``savepoint=False``) the batch is the whole transaction, and the dialect's
    ``finish`` may commit it (PostgreSQL does). In a group (``savepoint=True``) the
    batch runs inside its own savepoint, released at the end; if it raises, the
    transaction is rolled back to the savepoint (so nothing of the batch remains) and
    the error propagates.
    """
    if not savepoint:
        return _ingest(conn, dialect, run, batch, now, reload, None)
    try:  # the dialect's probe opens the savepoint
        return _ingest(conn, dialect, run, batch, now, reload, SAVEPOINT)
    except Exception:
        conn.exec_driver_sql(f"ROLLBACK TO SAVEPOINT {SAVEPOINT}")
        conn.exec_driver_sql(f"RELEASE SAVEPOINT {SAVEPOINT}")
        raise


def _ingest(
    conn: Connection,
    dialect: Dialect,
    run: RunRecord,
    batch: PreparedBatch,
    now: float,
    reload: Callable[[], RunRecord],
    savepoint: str | None,
) -> IngestOutcome:
    found = dialect.probe(conn, run, batch, now, savepoint)
    steps, new_frags = found.steps, found.new_frags
    collided = rules.duplicates(batch, found)
    if collided:
        stored = _stored_fragments(conn, dialect.sql, run, collided)
        rules.check_duplicates(batch, collided, stored)
    rules.check(batch, found)
    rules.count(steps, new_frags, {k: batch.commits[k] for k in found.new_commits})
    deferred = _partials(conn, dialect, run, batch, found, new_frags)
    finalised = _finalise(conn, dialect.sql, run, reload, steps.values(), now)
    dialect.finish(conn, run.id, [*steps.values()], savepoint, deferred)
    return IngestOutcome(
        accepted=len(new_frags),
        duplicates=len(batch.fragments) - len(new_frags),
        commits=len(found.new_commits),
        finalised=finalised,
    )


class NotMerged(Exception):
    """The group cannot be stored as one batch: store it one savepoint per batch."""


def ingest_merged(
    conn: Connection,
    dialect: Dialect,
    run: RunRecord,
    batches: list[tuple[PreparedBatch, float]],
    reload: Callable[[], RunRecord],
) -> list[IngestOutcome]:
    """Store ``batches`` (each with its arrival time) of ``run`` as one transaction
    of one batch's statements; their outcomes, in order. Raises :class:`NotMerged`
    (the caller rolls back) where that would differ from storing them one by one."""
    merged = merge([b for b, _ in batches])
    if merged is None:
        raise NotMerged("two batches share a (step, rank) pair")
    found = dialect.probe(conn, run, merged, min(now for _, now in batches), None)
    new_frags, new_commits = set(found.new_frags), set(found.new_commits)
    collided = set(merged.fragments) - new_frags
    stored = list(_stored_fragments(conn, dialect.sql, run, collided)) if collided else []
    touched = [set(b.steps()) for b, _ in batches]
    mine: list[tuple[list[FragmentKey], list[tuple[int, int]]]] = []
    for i, (batch, _) in enumerate(batches):
        frags = [k for k in batch.fragments if k in new_frags]
        commits = [k for k in batch.commits if k in new_commits]
        own = Probe(found.steps, frags, commits, found.declared, found.top_seq)
        try:
            rules.check_duplicates(batch, set(batch.fragments) - set(frags), stored)
            rules.check(batch, own)
        except Exception as exc:
            raise NotMerged(str(exc)) from exc
        rules.count(found.steps, frags, {k: batch.commits[k] for k in commits})
        later = set().union(*touched[i + 1 :])
        if any(rules.next_status(run.world_size, found.steps[s]) for s in touched[i] & later):
            raise NotMerged("a step is finalised before a later batch of the group")
        mine.append((frags, commits))
    deferred = _partials(conn, dialect, run, merged, found, found.new_frags)
    outcomes = []
    reload = _once(reload)
    for i, ((batch, now), (frags, commits)) in enumerate(zip(batches, mine, strict=True)):
        last = touched[i] - set().union(*touched[i + 1 :])  # steps no later batch touches
        rows = [found.steps[s] for s in sorted(last)]
        outcomes.append(
            IngestOutcome(
                accepted=len(frags),
                duplicates=len(batch.fragments) - len(frags),
                commits=len(commits),
                finalised=_finalise(conn, dialect.sql, run, reload, rows, now),
            )
        )
    dialect.finish(conn, run.id, [*found.steps.values()], None, deferred)
    return outcomes


def _partials(
    conn: Connection,
    dialect: Dialect,
    run: RunRecord,
    batch: PreparedBatch,
    found: Probe,
    new_frags: list[FragmentKey],
) -> list[PartialRow]:
    """Merge the new fragments into their partial rows: written now if the probe did
    not read the stored rows, or if a step is about to be finalised (it reads them);
    else returned, for the dialect's ``finish`` to write with the step rows."""
    if found.partials is None:
        write_partials(conn, dialect.sql, run, batch, new_frags)
        return []
    rows = merged_partials(run, batch, new_frags, found.partials)
    if any(rules.next_status(run.world_size, s) for s in found.steps.values()):
        upsert_partials(conn, dialect.sql, run.id, rows)
        return []
    return rows


def _once(read: Callable[[], RunRecord]) -> Callable[[], RunRecord]:
    kept: list[RunRecord] = []

    def once() -> RunRecord:
        if not kept:
            kept.append(read())
        return kept[0]

    return once


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
    sql: Statements,
    run: RunRecord,
    reload: Callable[[], RunRecord],
    rows: Iterable[StepState],
    now: float,
) -> list[FinalisedStep]:
    """Finalise the steps that :func:`~steptally.service.domain.step.next_status` names,
    against the run's current spec (read once, when the first one is finalised)."""
    out = []
    done: list[StepState] = []
    current: RunRecord | None = None
    for row in rows:
        status = rules.next_status(run.world_size, row)
        if status is None:
            continue
        current = current or reload()
        out.append(finalise_row(conn, sql, current, row, status, now, done))
        done.append(row)
    return out
