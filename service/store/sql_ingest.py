"""One batch into SQL, all or nothing: fetching and writing around the step rules of
:mod:`steptally.service.domain.step`.

A batch's transaction first holds the batch's (step, rank) pairs, so that no other
writer changes what the rules read of them; then the dialect's *probe* reads (and, on
PostgreSQL, inserts) what the checks need; the rules run; the dialect's *apply* writes
the new fragments and commits, each pair's partial row (the stored state merged with
the state of the pair's new fragments, :mod:`steptally.service.domain.partial`) and
the steps' counters, and returns the changed steps as they now stand. Only then are
steps finalised: inside the transaction on SQLite and for a batch in a savepoint (its
steps are finalised before the next batch of the group reads them); on PostgreSQL, a
batch stored alone or a merged group commits with its last round trip and the steps it
completed are finalised at once in a transaction of their own (:func:`finalise_due`),
so that a step's row is locked only for the moment its counters change. Any error
raises before anything is written, so a batch is all or nothing.

The probe and apply are dialect-specific (:class:`~.dialect.Dialect`); this module
only fetches and writes around the rules.

A group of batches (:mod:`.group_commit`) of one run whose (step, rank) pairs are
disjoint is stored by :func:`ingest_merged` with the statements of ONE batch: one
probe for all of them, then the rules of each batch in turn, in arrival order, over
what the probe found for its own keys, exactly as if each had run alone after the
ones before it. That holds while no batch's step is finalised before a later batch of
the group touches it; then, or when any batch breaks a rule, it raises
:class:`NotMerged` and the group is stored again one savepoint per batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol

from sqlalchemy import Connection

from steptally.service.domain import partial
from steptally.service.domain import step as rules
from steptally.service.domain.batch import CommitKey, FragmentKey, PreparedBatch, merge
from steptally.service.domain.packing import Cell, unbundled
from steptally.service.domain.progress import Progress, StepStatus
from steptally.service.domain.run import RunRecord
from steptally.service.domain.step import Delta, Probe, StepState
from steptally.service.errors import ServiceError
from steptally.service.store.dialect import Dialect
from steptally.service.store.protocol import FinalisedStep, IngestOutcome, StepRecord
from steptally.service.store.sql_statement import Statements, keys_params
from steptally.service.store.sql_step import PartialRow, PartsReader, RunKey, finalise_row

SAVEPOINT = "steptally_batch"
Reload = Callable[[], RunRecord]


class KeyedReload(Protocol):
    """The run as it stands, given what of it can change where that was read already."""

    def __call__(self, key: RunKey | None = None) -> RunRecord: ...


@dataclass(slots=True)
class Stored:
    """A batch stored, its steps not yet finalised: its counts, and the steps it
    changed as they now stand (to finalise those that :func:`due` names)."""

    outcome: IngestOutcome
    changed: list[StepState]


def ingest(
    conn: Connection,
    dialect: Dialect,
    run: RunRecord,
    batch: PreparedBatch,
    now: float,
    reload: Reload,
    savepoint: bool = False,
) -> Stored:
    """Store ``batch``; ``reload`` reads the run's current spec when a step is finalised.

    Alone (``savepoint=False``) the batch is the whole transaction, and the dialect's
    ``apply`` may commit it (PostgreSQL does: then the steps it changed are finalised
    by :func:`finalise_due` after it). In a group (``savepoint=True``) the batch runs
    inside its own savepoint, its steps finalised in it, released at the end; if it
    raises, the transaction is rolled back to the savepoint (so nothing of the batch
    remains) and the error propagates.
    """
    if not savepoint:
        fresh = ingest_fresh(conn, dialect, run, [(batch, now)], reload)
        if fresh is not None:
            return fresh[0]
        stored = _store(conn, dialect, run, batch, now, None)
        if not dialect.finalises_after_commit:
            stored.outcome.finalised.extend(
                _finalise(conn, dialect, run, reload, stored.changed, now)
            )
        return stored
    try:  # the dialect's probe opens the savepoint
        stored = _store(conn, dialect, run, batch, now, SAVEPOINT)
        stored.outcome.finalised.extend(_finalise(conn, dialect, run, reload, stored.changed, now))
        conn.exec_driver_sql(f"RELEASE SAVEPOINT {SAVEPOINT}")
        return stored
    except Exception:
        conn.exec_driver_sql(f"ROLLBACK TO SAVEPOINT {SAVEPOINT}")
        conn.exec_driver_sql(f"RELEASE SAVEPOINT {SAVEPOINT}")
        raise


def _store(
    conn: Connection,
    dialect: Dialect,
    run: RunRecord,
    batch: PreparedBatch,
    now: float,
    savepoint: str | None,
) -> Stored:
    found = dialect.probe(conn, run, batch, now, savepoint)
    collided = rules.duplicates(batch, found)
    if collided:  # read whole first: no cursor is left open when a check raises
        stored = list(_stored_fragments(conn, dialect.sql, run, collided))
        rules.check_duplicates(batch, collided, stored)
    rules.check(batch, found)
    deltas = rules.counted(batch, found)
    rows = partial_rows(run, batch, found)
    changed = dialect.apply(conn, run, batch, found, deltas, rows, now, alone=savepoint is None)
    outcome = IngestOutcome(
        accepted=len(found.new_frags),
        duplicates=len(batch.fragments) - len(found.new_frags),
        commits=len(found.new_commits),
        finalised=[],
    )
    return Stored(outcome, changed)


def ingest_fresh(
    conn: Connection,
    dialect: Dialect,
    run: RunRecord,
    batches: Sequence[tuple[PreparedBatch, float]],
    reload: Reload | None = None,
) -> list[Stored] | None:
    """Store ``batches`` (each with its arrival time, no two sharing a (step, rank)
    pair) of ``run`` as ONE new batch (:meth:`~.dialect.Dialect.store_fresh`: on
    PostgreSQL the whole transaction, committed; on SQLite, plain pairs only, inside the
    group's transaction, their completed steps finalised there with ``reload``), where
    nothing of their pairs is stored yet and none of their steps is finalised: what a
    reporter sends, each rank each step once. The rules run as they would against a
    store holding nothing of the pairs, so every fragment and commit is new and the
    steps' counters gain all of them. Returns what :func:`ingest_merged` would, or None,
    with nothing stored, when the dialect found something stored, a step finalised, or
    the rules would refuse a batch (then the caller stores them as before, and that path
    says what is wrong)."""
    if not dialect.finalises_after_commit and not all(b.is_plain() for b, _ in batches):
        return None  # SQLite's fresh write takes only plain pairs: not worth its rules
    fresh = fresh_write(run, batches)
    if fresh is None:
        return None
    changed = dialect.store_fresh(conn, run, fresh.batch, fresh.added, fresh.partials, fresh.now)
    if changed is None:
        return None
    out = fresh_outcomes(batches, changed)
    if not dialect.finalises_after_commit:  # inside the transaction, as ingest_merged does
        assert reload is not None, "a dialect that finalises inside needs the run's reload"
        reload = _once(reload)
        for one, (_, now) in zip(out, batches, strict=True):
            one.outcome.finalised.extend(_finalise(conn, dialect, run, reload, one.changed, now))
    return out


class Fresh(NamedTuple):
    """What a fresh write hands the dialect: the merged batch, what its steps gain, its
    partial rows and its time; and its steps as the write leaves them where nothing of
    them was stored before (for :func:`finalise_fresh`)."""

    batch: PreparedBatch
    added: Mapping[int, Delta]
    partials: list[PartialRow]
    now: float
    steps: Mapping[int, StepState]


def fresh_write(run: RunRecord, batches: Sequence[tuple[PreparedBatch, float]]) -> Fresh | None:
    """What :func:`ingest_fresh` hands the dialect to write ``batches`` as one; None
    where they cannot be (two of one pair, nothing to write, a batch the rules would
    refuse: the general way says what is wrong)."""
    merged = batches[0][0] if len(batches) == 1 else merge([b for b, _ in batches])
    if not merged:  # two batches of one pair, or nothing to write
        return None
    now = min(t for _, t in batches)
    assumed = rules.probe_from(run, merged, now, {}, set(), {}, {})
    try:
        rules.check(merged, assumed)
    except ServiceError:
        return None
    added = rules.counted(merged, assumed)
    return Fresh(merged, added, partial_rows(run, merged, assumed), now, assumed.steps)


@dataclass(slots=True)
class OpenStep:
    """Every pair stored of an open step, as the writer that stored them all knows
    them: the step's row as its last write left it, each rank's declared fragments and
    partial row (fragments, state), and their sums (what the row's counters count)."""

    row: StepState
    commits: dict[int, int]
    parts: dict[int, tuple[int, bytes]]
    expected: int
    received: int

    @classmethod
    def of(cls, row: StepState, fresh: Fresh, before: OpenStep | None) -> OpenStep | None:
        """The step of ``row`` (as ``fresh``'s write, committed, left it) with ``fresh``'s
        pairs added to ``before`` (what the same writer knew of it, taken over: a step
        of 4096 ranks gains 8 pairs a group); None where the row counts more than those
        pairs (another writer's are stored too: each stored pair adds to its counters)
        or the step is not open."""
        if row.status is not StepStatus.OPEN or row.revision:
            return None
        step = row.step
        known = before or cls(row, {}, {}, 0, 0)
        for (s, r), n in fresh.batch.commits.items():
            if s == step:
                known.commits[r] = n
                known.expected += n
        for s, r, n, st in fresh.partials:
            if s == step:
                known.parts[r] = (n, st)
                known.received += n
        counted = (len(known.commits), known.expected, known.received)
        if (row.committed_ranks, row.expected, row.received) != counted:
            return None
        known.row = row
        return known


def finalise_fresh(
    run: RunRecord, fresh: Fresh, now: float, known: Mapping[int, OpenStep] | None = None
) -> list[tuple[StepState, FinalisedStep]]:
    """The steps that ``fresh`` completes, finalised at ``now`` from partial states
    alone, as :func:`finalise_row` would finalise them from the stored ones once it
    committed: a step of which nothing is stored (every rank of it in ``fresh``), or one
    of ``known`` (every pair of it stored by this writer, :class:`OpenStep`) that
    ``fresh`` completes. Those pairs are then all of the step, so their states merge
    into the same bits; the write checks in its transaction that the step's row is
    still the one this takes (:data:`~.sql_statement.PIPELINE` ``finalise_fresh``).
    Each comes as its row finalised (``values`` to write, its counters as the write
    leaves them) and its finalisation. A step is left to the finalisation after the
    commit (none comes back) where the run has a change rule (which reads earlier
    steps' values) or the step breaks a rule (its breach is written there); ``run`` is
    the run as a finalisation reads it, spec and columns current."""
    if any(rule.window is not None for rule in run.spec.alerts):
        return []
    out = []
    for step, state in fresh.steps.items():
        commits = {r: n for (s, r), n in fresh.batch.commits.items() if s == step}
        parts = [(r, n, st) for s, r, n, st in fresh.partials if s == step]
        before = (known or {}).get(step)
        if before is not None:
            if any(r in before.commits for r in commits):  # not new: its write fails
                continue
            added = fresh.added.get(step, Delta())
            b = before.row
            state = replace(
                b,
                committed_ranks=b.committed_ranks + added.committed,
                expected=b.expected + added.expected,
                received=b.received + added.received,
                missing_ranks=b.missing_ranks - added.committed,
                changed=True,
            )
        if rules.next_status(run.world_size, state) is not StepStatus.COMPLETE:
            continue
        if before is not None:  # (a group's work, not the step's, until it completes)
            commits |= before.commits
            parts += [(r, n, st) for r, (n, st) in before.parts.items()]
        progress = Progress(run.world_size, commits, {r: n for r, n, _ in parts})
        row = replace(state, values=[], breaches=[])  # the write's own row stays as it was
        cells = partial.merged(run, (st for *_, st in parts))
        result = rules.finalise(run, row, progress, cells, StepStatus.COMPLETE, now)
        if row.breaches:
            return []
        record = StepRecord(step, row.status, row.revision, row.first_seen_at, now, result)
        out.append((row, FinalisedStep(run.name, step, row.status, row.revision, run, record)))
    return out


def finalised_with(stored: Sequence[Stored], done: Mapping[int, FinalisedStep]) -> None:
    """The finalisations ``done`` (by step) made inside a group's transaction, each
    added to the outcome of the batch that was the last of the group to change its
    step; those steps are then not to be finalised again."""
    for one in stored:
        keep = []
        for row in one.changed:
            if row.step in done:
                one.outcome.finalised.append(done[row.step])
            else:
                keep.append(row)
        one.changed = keep


def fresh_outcomes(
    batches: Sequence[tuple[PreparedBatch, float]], changed: Iterable[StepState]
) -> list[Stored]:
    """Each batch's outcome once :func:`fresh_write`'s write committed, ``changed`` the
    step rows it returned."""
    touched = [set(b.steps()) for b, _ in batches]
    return _outcomes(batches, touched, _later(touched), changed)


def _outcomes(
    batches: Sequence[tuple[PreparedBatch, float]],
    touched: Sequence[set[int]],
    later: Sequence[set[int]],
    changed: Iterable[StepState],
    mine: Sequence[tuple[Sequence[FragmentKey], Sequence[CommitKey]]] | None = None,
) -> list[Stored]:
    """Each batch of a group stored as one: its counts (``mine``: the fragments and
    commits of its that were new; None: all of them) and the steps it was the last of
    the group to change, to be finalised (after the commit)."""
    by_step = {r.step: r for r in changed}
    out = []
    for i, (batch, _) in enumerate(batches):
        frags, commits = (batch.fragments, batch.commits) if mine is None else mine[i]
        last = touched[i] - later[i]  # steps no later batch touches
        mine_changed = [by_step[s] for s in sorted(last) if s in by_step]
        outcome = IngestOutcome(len(frags), len(batch.fragments) - len(frags), len(commits), [])
        out.append(Stored(outcome, mine_changed))
    return out


class NotMerged(Exception):
    """The group cannot be stored as one batch: store it one savepoint per batch."""


def ingest_merged(
    conn: Connection,
    dialect: Dialect,
    run: RunRecord,
    batches: list[tuple[PreparedBatch, float]],
    reload: Reload,
) -> list[Stored]:
    """Store ``batches`` (each with its arrival time) of ``run`` as one transaction
    of one batch's statements; each one's counts and, on the last batch that touches
    it, each step the group changed (finalised inside the transaction where the dialect
    does). Raises :class:`NotMerged` (the caller rolls back) where that would differ
    from storing them one by one."""
    merged = merge([b for b, _ in batches])
    if merged is None:
        raise NotMerged("two batches share a (step, rank) pair")
    found = dialect.probe(conn, run, merged, min(now for _, now in batches), None)
    # nothing of the group stored before: every fragment and commit of it new
    every = (len(found.new_frags), len(found.new_commits)) == (
        len(merged.fragments),
        len(merged.commits),
    )
    new_frags, new_commits = (
        (set(), set()) if every else (set(found.new_frags), set(found.new_commits))
    )
    collided = set() if every else set(merged.fragments) - new_frags
    stored = list(_stored_fragments(conn, dialect.sql, run, collided)) if collided else []
    touched = [set(b.steps()) for b, _ in batches]
    later = _later(touched)  # later[i]: the steps a batch after batch i touches
    mine: list[tuple[list[FragmentKey], list[CommitKey]]] = []
    deltas: dict[int, Delta] = {}
    for i, (batch, _) in enumerate(batches):
        if every:
            frags, commits = list(batch.fragments), list(batch.commits)
        else:
            frags = [k for k in batch.fragments if k in new_frags]
            commits = [k for k in batch.commits if k in new_commits]
        own = Probe(found.steps, frags, commits, found.declared, found.top_seq)
        try:
            if len(frags) < len(batch.fragments):
                rules.check_duplicates(batch, set(batch.fragments) - set(frags), stored)
            rules.check(batch, own)
        except Exception as exc:
            raise NotMerged(str(exc)) from exc
        for s, d in rules.counted(batch, own).items():
            total = deltas.setdefault(s, Delta())
            total.received, total.committed = (
                total.received + d.received,
                total.committed + d.committed,
            )
            total.expected += d.expected
        if any(rules.next_status(run.world_size, found.steps[s]) for s in touched[i] & later[i]):
            raise NotMerged("a step is finalised before a later batch of the group")
        mine.append((frags, commits))
    rows = partial_rows(run, merged, found)
    now = min(now for _, now in batches)
    changed = dialect.apply(conn, run, merged, found, deltas, rows, now, True)
    out = _outcomes(batches, touched, later, changed, mine)
    if not dialect.finalises_after_commit:
        reload = _once(reload)
        for one, (_, now) in zip(out, batches, strict=True):
            one.outcome.finalised.extend(_finalise(conn, dialect, run, reload, one.changed, now))
    return out


def _later(touched: Sequence[set[int]]) -> list[set[int]]:
    """For each of ``touched`` (the steps of each batch of a group), the steps of the
    batches after it."""
    out: list[set[int]] = []
    after: set[int] = set()
    for steps in reversed(touched):
        out.append(after)
        after = after | steps
    out.reverse()
    return out


def partial_rows(run: RunRecord, batch: PreparedBatch, found: Probe) -> list[PartialRow]:
    """The partial rows of the pairs that gain fragments: the stored state merged with
    the state of the pair's new fragments (the batch's own state of the pair when every
    fragment of it is new, which it computed before the transaction)."""
    if rules.all_new(batch, found):  # a pair at a time, each with the state it brought
        plain = _plain_partials(run, batch, found)
        if plain is not None:
            return plain
    cells: dict[CommitKey, list[Cell]] = {}
    for key in found.new_frags:
        cells.setdefault(key[:2], []).append(batch.fragments[key])
    out = []
    for pair, new in cells.items():
        size, state = batch.states.get(pair, (0, None))
        if state is None or size != len(new):  # not computed, or some were stored before
            state = partial.state_of(run, new)
        n, before = found.partials.get(pair, (0, b""))
        if n:
            state = partial.merge(run, [before, state])
        out.append((pair[0], pair[1], n + len(new), state))
    return out


def _plain_partials(run: RunRecord, batch: PreparedBatch, found: Probe) -> list[PartialRow] | None:
    """:func:`partial_rows` of a batch whose fragments are all new and plain; None if a
    pair's state was not computed with the batch."""
    out = []
    states, stored = batch.states, found.partials
    for pair, (n, _) in batch.plain.items():
        size, state = states.get(pair, (0, b""))
        if size != n:
            return None
        before_n, before = stored.get(pair, (0, b""))
        if before_n:
            state = partial.merge(run, [before, state])
        out.append((pair[0], pair[1], before_n + n, state))
    return out


def due(world_size: int, rows: Iterable[StepState]) -> list[StepState]:
    """The steps of ``rows`` (as a batch changed them) that are finalised now."""
    return [r for r in rows if rules.next_status(world_size, r) is not None]


def finalise_due(
    conn: Connection,
    dialect: Dialect,
    run: RunRecord,
    reload: KeyedReload,
    steps: Sequence[int],
    now: float,
    last: bool = False,
) -> list[FinalisedStep]:
    """Lock ``steps`` (which a committed batch changed) and finalise those that are
    due as they stand now: each once, whoever else finalised them meanwhile.
    ``last``: the transaction ends with it (its writes may commit it)."""
    rows, read, key = dialect.lock_steps(conn, run.id, sorted(steps))
    for row in rows:
        row.changed = True  # the batch changed it; a step finalised since is passed over
    return _finalise(conn, dialect, run, lambda: reload(key), rows, now, read, last)


def _once(read: Reload) -> Reload:
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
    for s, r, key, values, present, tails, seqs in conn.execute(
        sql.fragments_of, keys_params(run.id, keys)
    ):
        for q, (v, p, t) in unbundled(
            key, bytes(values), _bytes(present), _bytes(tails), _bytes(seqs)
        ):
            yield s, r, q, v, p, t


def _bytes(b: bytes | None) -> bytes | None:
    return None if b is None else bytes(b)


def _finalise(
    conn: Connection,
    dialect: Dialect,
    run: RunRecord,
    reload: Reload,
    rows: Iterable[StepState],
    now: float,
    read: PartsReader | None = None,
    last: bool = False,
) -> list[FinalisedStep]:
    """Finalise the steps that :func:`~steptally.service.domain.step.next_status` names
    (against the run's current spec, read once when the first one is), and write them
    (``read``: what reads a step's parts; the dialect's ``read_parts`` by default)."""
    out = []
    done: list[StepState] = []
    current: RunRecord | None = None
    for row in rows:
        status = rules.next_status(run.world_size, row)
        if status is None:
            continue
        current = current or reload()
        out.append(finalise_row(conn, read or dialect.read_parts, current, row, status, now, done))
        done.append(row)
    if done:
        dialect.write_steps(conn, run.id, done, last)
    return out
