"""Step rows in SQL: lock them, load what a finalisation needs, finalise, write back.

A step row carries counters (ranks committed, fragments expected and received) so
that completeness is known without reading fragments; only a finalisation, or a
read of an open step, loads the fragments themselves.

Every finalisation also writes one ``step_values`` row per metric and derived value
of the step; a later finalisation of the same step (a higher revision) overwrites
them, and a metric added to the run since then gains its row.

A batch's new fragments are also merged, exactly, into one ``partials`` row per
(step, rank) (:func:`.sql_ingest.partial_rows`, while the batch holds the pair), and a
finalisation
merges the step's partial rows (:func:`load_partials`) instead of reading every
fragment: world size rows, not world size times microbatches. A step whose partials
do not hold every fragment it received (stored before partials existed) is evaluated
from its fragments (:func:`load_live`).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import orjson
from sqlalchemy import Connection, Select, bindparam, select, union_all

from steptally.client.algebra.alerts import History
from steptally.service.domain import partial
from steptally.service.domain import step as step_rules
from steptally.service.domain.batch import CommitKey, FragmentKey, PreparedBatch
from steptally.service.domain.finalise import Contributions, StoredValue, ValueState
from steptally.service.domain.packing import Cell, bundled, seqs_of, unbundled
from steptally.service.domain.progress import Progress, StepStatus
from steptally.service.domain.run import RunRecord
from steptally.service.domain.step import StepState, opened
from steptally.service.store.protocol import FinalisedStep, StepRecord
from steptally.service.store.sql_statement import (
    COMMITS,
    FRAGMENTS,
    PARTIALS,
    STATE_COLUMNS,
    STEP_VALUES,
    STEPS,
    Statements,
)

ForUpdate = Callable[[Select[Any]], Select[Any]]


def state_of(row: Any) -> StepState:
    """A step row as read from the database."""
    return StepState(
        step=row.step,
        status=StepStatus(row.status),
        revision=row.revision,
        committed_ranks=row.committed_ranks,
        expected=row.expected,
        received=row.received,
        missing_ranks=row.missing_ranks,
        first_seen_at=row.first_seen_at,
        deadline=row.deadline,
        finalised_at=row.finalised_at,
        result=row.result,
    )


#: a partials row to write: step, rank, fragments, state
PartialRow = tuple[int, int, int, bytes]


def state_of_tuple(row: Sequence[Any]) -> StepState:
    """A step row read through the driver, every column in table order."""
    _, step, status, revision, committed, expected, received, missing = row[:8]
    first_seen_at, deadline, finalised_at, result = row[8:]
    return StepState(
        step, StepStatus(status), revision, committed, expected, received, missing,
        first_seen_at, deadline, finalised_at, result,
    )  # fmt: skip


def step_tuple(run_id: int, row: StepState) -> tuple[Any, ...]:
    """A step row for the driver, every column in table order."""
    return (
        run_id, row.step, row.status.value, row.revision, row.committed_ranks, row.expected,
        row.received, row.missing_ranks, row.first_seen_at, row.deadline, row.finalised_at,
        row.result,
    )  # fmt: skip


def new_row(run: RunRecord, step: int, now: float) -> dict[str, Any]:
    """The columns of a new step row (:func:`~steptally.service.domain.step.opened`)."""
    state = opened(run, step, now)
    out: dict[str, Any] = {c: getattr(state, c) for c in STATE_COLUMNS}
    out["run_id"], out["status"] = run.id, state.status.value
    return out


# a finalisation's statements, built once (SQLAlchemy then finds each compiled in its
# cache at once, instead of building, coercing and keying it anew: a fifth of a
# finalisation's CPU at 8 ranks, where every eighth body finalises a step)
_STEPS_OF = (
    select(STEPS)
    .where(STEPS.c.run_id == bindparam("run"), STEPS.c.step.in_(bindparam("steps", expanding=True)))
    .order_by(STEPS.c.step)
)
_COMMITS_OF_STEP = select(COMMITS.c.rank, COMMITS.c.fragments).where(
    COMMITS.c.run_id == bindparam("run"), COMMITS.c.step == bindparam("step")
)
_PARTIALS_OF_STEP = select(PARTIALS.c.rank, PARTIALS.c.fragments, PARTIALS.c.state).where(
    PARTIALS.c.run_id == bindparam("run"), PARTIALS.c.step == bindparam("step")
)

#: a step's partial rows ``(rank, fragments, state)`` and commits ``(rank, fragments)``
StepParts = tuple[list[tuple[int, int, bytes]], list[tuple[int, int]]]
#: reads :data:`StepParts` of ``(run_id, step)``: the dialect's ``read_parts``
PartsReader = Callable[[Connection, int, int], StepParts]
#: what of a run can change, as :class:`~.sql_run.KnownRuns` compares it
RunKey = tuple[Any, ...]


class Locked(NamedTuple):
    """What a dialect's ``lock_steps`` gives: the rows of the steps that exist, locked in
    step order; what reads a step's parts from then on; and, where the dialect read it
    in the same round trip, the run's :data:`RunKey` (else None: read it when needed)."""

    rows: list[StepState]
    read: PartsReader
    run_key: RunKey | None


def read_parts(conn: Connection, run_id: int, step: int) -> StepParts:
    """A step's partial rows and commits, two statements through SQLAlchemy: the plain
    reading the dialects' own ``read_parts`` are checked against."""
    params = {"run": run_id, "step": step}
    parts = [(r, n, bytes(st)) for r, n, st in conn.execute(_PARTIALS_OF_STEP, params)]
    commits = [(r, n) for r, n in conn.execute(_COMMITS_OF_STEP, params)]
    return parts, commits


@functools.lru_cache(maxsize=16)  # one a dialect
def _locked_steps_of(for_update: ForUpdate) -> Select[Any]:
    return for_update(_STEPS_OF)


def lock_steps_of(
    conn: Connection, for_update: ForUpdate, run_id: int, steps: Sequence[int]
) -> list[StepState]:
    """The rows of ``steps`` that exist, locked in step order."""
    params = {"run": run_id, "steps": list(steps)}
    return [state_of(r) for r in conn.execute(_locked_steps_of(for_update), params)]


def lock_step(conn: Connection, for_update: ForUpdate, run_id: int, step: int) -> StepState | None:
    stmt = select(STEPS).where(STEPS.c.run_id == run_id, STEPS.c.step == step)
    row = conn.execute(for_update(stmt)).first()
    return None if row is None else state_of(row)


def write_breaches(
    conn: Connection, sql: Statements, run_id: int, rows: Sequence[StepState]
) -> None:
    """The breaches found by the finalisations of this transaction (rare: one statement,
    only when there are some)."""
    found = [
        {
            "run_id": run_id,
            "step": r.step,
            "rule": b["rule"],
            "revision": r.revision,
            "finalised_at": r.finalised_at,
            "breach": orjson.dumps(b).decode(),
        }
        for r in rows
        if r.changed
        for b in r.breaches
    ]
    if found:
        conn.execute(sql.insert_breaches, found)


class PendingValues(NamedTuple):
    """``(step, (col, value, state))`` of every row finalised in this transaction:
    ``first`` those of steps finalised for the first time (revision 1: a step has
    values only once finalised, so none of theirs is stored and a plain insert writes
    them), ``revised`` the others' (each replacing the value stored for its column).
    Upserting a first finalisation's values cost PostgreSQL ~150 µs more a step of 48
    values than inserting them (bench/README.md, Scale, stop 17)."""

    first: list[tuple[int, StoredValue]]
    revised: list[tuple[int, StoredValue]]


def pending_values(rows: Sequence[StepState]) -> PendingValues:
    out = PendingValues([], [])
    for r in rows:
        if r.changed and r.values:
            (out.first if r.revision == 1 else out.revised).extend((r.step, v) for v in r.values)
    return out


def load_live(conn: Connection, run: RunRecord, step: int) -> tuple[Progress, list[Cell]]:
    """Everything a step's evaluation needs: commits, arrivals per rank, fragments."""
    commits = conn.execute(_COMMITS_OF_STEP, {"run": run.id, "step": step}).all()
    cols = FRAGMENTS.c
    rows = conn.execute(
        select(cols.rank, *FRAGMENT_CELLS).where(cols.run_id == run.id, cols.step == step)
    ).all()
    received: Counter[int] = Counter()
    cells: list[Cell] = []
    for rank, *row in rows:
        mine = unbundled(*row)
        received[rank] += len(mine)
        cells.extend(cell for _, cell in mine)
    progress = Progress(run.world_size, {c.rank: c.fragments for c in commits}, received)
    return progress, cells


#: what a stored fragments row holds of its fragments: for packing.unbundled
FRAGMENT_CELLS = (
    FRAGMENTS.c.seq,
    FRAGMENTS.c.values_f64,
    FRAGMENTS.c.present,
    FRAGMENTS.c.tails,
    FRAGMENTS.c.seqs,
)


def fragment_rows(
    run_id: int, batch: PreparedBatch, new_frags: Sequence[FragmentKey]
) -> list[tuple[Any, ...]]:
    """The fragments rows to store for the new fragments of ``batch``: per (step, rank),
    one bundle where they allow it (:func:`~steptally.service.domain.packing.bundled`),
    else a row each; every column in table order."""
    if len(new_frags) == len(batch.fragments) and batch.is_plain():  # a pair at a time
        return [
            (run_id, s, r, n - 1, values, None, None, seqs_of(n) if n > 1 else None)
            for (s, r), (n, values) in batch.plain.items()
        ]
    pairs: dict[CommitKey, list[tuple[int, Cell]]] = {}
    for s, r, q in new_frags:
        pairs.setdefault((s, r), []).append((q, batch.fragments[(s, r, q)]))
    out: list[tuple[Any, ...]] = []
    for (s, r), cells in pairs.items():
        bundle = bundled(cells)
        if bundle is None:
            out.extend((run_id, s, r, q, v, p, t, None) for q, (v, p, t) in cells)
        else:
            key, values, seqs = bundle
            out.append((run_id, s, r, key, values, None, None, seqs))
    return out


def load_partials(
    conn: Connection, read: PartsReader, run: RunRecord, row: StepState
) -> tuple[Progress, Contributions] | None:
    """A step's commits, arrivals per rank and merged partial state (``read``: the
    dialect's ``read_parts``); None when its partial rows do not hold every fragment
    the step received."""
    parts, commits = read(conn, run.id, row.step)
    received = Counter({rank: n for rank, n, _ in parts})
    if received.total() != row.received:
        return None
    progress = Progress(run.world_size, dict(commits), received)
    return progress, partial.merged(run, (state for _, _, state in parts))


def history(
    conn: Connection, run: RunRecord, step: int, earlier: Sequence[StepState] = ()
) -> History:
    """What the run's change rules compare ``step`` with: the stored values of the
    nearest earlier steps (one statement for every rule), and those of ``earlier``
    (finalised in this transaction, not yet written); a value that is not a number
    reads as NaN."""
    windows: dict[int, int] = {}
    for rule in run.spec.alerts:
        col = run.value_column_of.get(rule.metric or "")
        if rule.window is not None and col is not None:
            windows[col] = max(windows.get(col, 0), rule.window)
    found: dict[int, dict[int, tuple[float | None, int]]] = {col: {} for col in windows}
    if windows:
        v = STEP_VALUES.c
        nearest = [
            select(v.col, v.step, v.value, v.state)
            .where(v.run_id == run.id, v.col == col, v.step < step)
            .order_by(v.step.desc())
            .limit(n)
            .subquery()
            for col, n in windows.items()
        ]
        parts = [select(*q.c) for q in nearest]
        for col, s, value, state in conn.execute(union_all(*parts) if len(parts) > 1 else parts[0]):
            found[col][s] = (value, state)
        for other in earlier:
            if other.step < step:
                for col, value, state in other.values:
                    if col in found:
                        found[col][other.step] = (value, state)
    number = ValueState.NUMBER.value

    def read(metric: str, n: int) -> list[float]:
        mine = found.get(run.value_column_of.get(metric, _NO_COL), {})
        steps = sorted(mine, reverse=True)[:n]
        return [mine[s][0] if mine[s][1] == number else math.nan for s in steps]  # type: ignore[misc]

    return read


_NO_COL = -(2**31)


def finalise_row(
    conn: Connection,
    read: PartsReader,
    run: RunRecord,
    row: StepState,
    status: StepStatus | None,
    now: float,
    earlier: Sequence[StepState] = (),
) -> FinalisedStep:
    """Finalise a locked step as ``status`` (None: complete if it is, else partial),
    from its partial rows where they hold every fragment (``read``: the dialect's
    ``read_parts``), else from its fragments, and check the run's alert rules against
    it (``earlier``: the steps finalised before it in this transaction)."""
    progress, cells = load_partials(conn, read, run, row) or load_live(conn, run, row.step)
    result = step_rules.finalise(
        run, row, progress, cells, status, now, history(conn, run, row.step, earlier)
    )
    record = StepRecord(row.step, row.status, row.revision, row.first_seen_at, now, result)
    return FinalisedStep(run.name, row.step, row.status, row.revision, run, record)
