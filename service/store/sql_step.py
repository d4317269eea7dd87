"""Step rows in SQL: lock them, load what a finalisation needs, and finalise.

A step row carries counters (ranks committed, fragments expected and received) so
that completeness is known without reading fragments; only a finalisation, or a
read of an open step, loads the fragments themselves.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from sqlalchemy import Connection, select

from steptally.service.domain import finalise
from steptally.service.domain.cells import Cell
from steptally.service.domain.progress import Progress, StepStatus
from steptally.service.domain.run import RunRecord
from steptally.service.store.base import FinalisedStep, StepRecord
from steptally.service.store.sql_statement import (
    COMMITS,
    FRAGMENTS,
    STEP_FIELDS,
    STEPS,
    statements,
)
from steptally.service.store.sql_values import write_values


@dataclass(slots=True)
class StepRow:
    """A locked step row, changed in memory and written back once."""

    step: int
    status: StepStatus
    revision: int
    committed_ranks: int
    expected: int
    received: int
    missing_ranks: int
    first_seen_at: float
    deadline: float
    finalised_at: float | None
    result: str | None
    changed: bool = False
    values: list[finalise.StoredValue] = field(default_factory=list)  # to write, if finalised

    @classmethod
    def of(cls, row: Any) -> StepRow:
        return cls(
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


@dataclass(slots=True)
class Probe:
    """What a batch's transaction knows after locking its steps and inserting its rows.

    ``declared`` holds the stored commits (new or old) that the checks need, by
    (step, rank); ``top_seq`` the highest stored ``seq`` of each newly committing pair.
    """

    steps: dict[int, StepRow]
    new_frags: list[tuple[int, int, int]]
    new_commits: list[tuple[int, int]]
    declared: dict[tuple[int, int], int]
    top_seq: dict[tuple[int, int], int]


def lock_steps(
    conn: Connection, run: RunRecord, steps: Sequence[int], now: float
) -> dict[int, StepRow]:
    """Create the rows of new steps and lock them all, in step order (no deadlocks)."""
    if not steps:
        return {}
    stmt = statements(conn.dialect.name).upsert_steps
    rows = conn.execute(stmt, [_new_step(run, s, now) for s in steps]).all()
    return {r.step: StepRow.of(r) for r in rows}


def _new_step(run: RunRecord, step: int, now: float) -> dict[str, Any]:
    return {
        "run_id": run.id,
        "step": step,
        "status": StepStatus.OPEN.value,
        "revision": 0,
        "committed_ranks": 0,
        "expected": 0,
        "received": 0,
        "missing_ranks": run.world_size,
        "first_seen_at": now,
        "deadline": now + run.step_timeout_s,
        "finalised_at": None,
        "result": None,
    }


def lock_step(conn: Connection, run_id: int, step: int) -> StepRow | None:
    stmt = select(STEPS).where(STEPS.c.run_id == run_id, STEPS.c.step == step)
    if conn.dialect.name == "postgresql":
        stmt = stmt.with_for_update()
    row = conn.execute(stmt).first()
    return None if row is None else StepRow.of(row)


def write_steps(conn: Connection, run_id: int, rows: Sequence[StepRow]) -> None:
    """Write the changed step rows and the values of those just finalised."""
    write_values(conn, run_id, pending_values(rows))
    params = [
        {"k_run": run_id, "k_step": r.step, **{f"v_{c}": getattr(r, c) for c in STEP_FIELDS}}
        for r in rows
        if r.changed
    ]
    for p in params:
        p["v_status"] = p["v_status"].value
    if params:
        conn.execute(statements(conn.dialect.name).update_steps, params)


def pending_values(rows: Sequence[StepRow]) -> list[tuple[int, finalise.StoredValue]]:
    """``(step, (col, value, state))`` of every row finalised in this transaction."""
    return [(r.step, v) for r in rows if r.changed for v in r.values]


def load_live(conn: Connection, run: RunRecord, step: int) -> tuple[Progress, list[Cell]]:
    """Everything a step's evaluation needs: commits, arrivals per rank, fragments."""
    commits = conn.execute(
        select(COMMITS.c.rank, COMMITS.c.fragments).where(
            COMMITS.c.run_id == run.id, COMMITS.c.step == step
        )
    ).all()
    cols = FRAGMENTS.c
    frags = conn.execute(
        select(cols.rank, cols.values_f64, cols.present, cols.tails).where(
            cols.run_id == run.id, cols.step == step
        )
    ).all()
    received = Counter(f.rank for f in frags)
    progress = Progress(run.world_size, {c.rank: c.fragments for c in commits}, received)
    return progress, [(f.values_f64, f.present, f.tails) for f in frags]


def finalise_row(
    conn: Connection, run: RunRecord, row: StepRow, status: StepStatus | None, now: float
) -> FinalisedStep:
    """Finalise a locked step as ``status`` (None: complete if it is, else partial)."""
    progress, cells = load_live(conn, run, row.step)
    status = status or finalise.final_status(progress)
    previous = None
    if row.status is StepStatus.PARTIAL and row.result is not None:
        previous = finalise.StepResult.from_json(orjson.loads(row.result))
    result = finalise.with_late_ranks(finalise.evaluate(run, progress, cells, status), previous)
    row.status = status
    row.revision += 1
    row.finalised_at = now
    row.result = orjson.dumps(result.to_json()).decode()
    row.missing_ranks = len(result.ranks_missing)
    row.values = finalise.stored_values(run, result)
    row.changed = True
    record = StepRecord(row.step, status, row.revision, row.first_seen_at, now, result)
    return FinalisedStep(run.name, row.step, status, row.revision, run, record)
