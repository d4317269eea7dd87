"""Reads: steps, run summaries and the exposition snapshot (no N+1 queries)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import orjson
from sqlalchemy import Connection, Row, func, select, tuple_

from steptally.service.domain.finalise import StepResult, shown_value
from steptally.service.domain.progress import StepStatus
from steptally.service.domain.run import RunRecord, RunSnapshot, RunSummary
from steptally.service.store.protocol import BreachRecord, StepRecord
from steptally.service.store.sql_statement import BREACHES, STEPS
from steptally.service.store.sql_step import load_live

_FINAL = (StepStatus.COMPLETE.value, StepStatus.PARTIAL.value)


def _record(conn: Connection, run: RunRecord, row: Row[Any], live: bool) -> StepRecord:
    status = StepStatus(row.status)
    result = None if row.result is None else StepResult.from_json(orjson.loads(row.result))
    record = StepRecord(
        row.step,
        status,
        row.revision,
        row.first_seen_at,
        row.finalised_at,
        result,
        counters=(row.committed_ranks, row.expected),
    )
    if live and status is StepStatus.OPEN:
        progress, cells = load_live(conn, run, row.step)
        record = replace(record, progress=progress, fragments=cells)
    return record


def get_step(conn: Connection, run: RunRecord, step: int, live: bool) -> StepRecord | None:
    row = conn.execute(select(STEPS).where(STEPS.c.run_id == run.id, STEPS.c.step == step)).first()
    return None if row is None else _record(conn, run, row, live)


def list_steps(
    conn: Connection, run: RunRecord, start: int | None, end: int | None, limit: int, live: bool
) -> list[StepRecord]:
    stmt = select(STEPS).where(STEPS.c.run_id == run.id)
    if start is not None:
        stmt = stmt.where(STEPS.c.step >= start)
    if end is not None:
        stmt = stmt.where(STEPS.c.step <= end)
    rows = conn.execute(stmt.order_by(STEPS.c.step).limit(limit)).all()
    return [_record(conn, run, row, live) for row in rows]


def finalised_since(
    conn: Connection, run: RunRecord, after: tuple[float, int], limit: int
) -> list[StepRecord]:
    c = STEPS.c
    stmt = (
        select(STEPS)
        .where(c.run_id == run.id, c.finalised_at.is_not(None))
        .where(tuple_(c.finalised_at, c.step) > tuple_(*after))
        .order_by(c.finalised_at, c.step)
        .limit(limit)
    )
    return [_record(conn, run, row, False) for row in conn.execute(stmt)]


def newest_finalised(conn: Connection, run: RunRecord) -> tuple[float, int, int] | None:
    c = STEPS.c
    stmt = (
        select(c.finalised_at, c.step, c.revision)
        .where(c.run_id == run.id, c.finalised_at.is_not(None))
        .order_by(c.finalised_at.desc(), c.step.desc())
        .limit(1)
    )
    row = conn.execute(stmt).first()
    return None if row is None else (row.finalised_at, row.step, row.revision)


def _status_counts(
    conn: Connection, run_ids: list[int] | None = None
) -> dict[int, dict[str, tuple[int, int, int | None]]]:
    """Per run (of ``run_ids``, None: all) and status: number of steps, missing ranks
    summed, highest step."""
    c = STEPS.c
    stmt = select(c.run_id, c.status, func.count(), func.sum(c.missing_ranks), func.max(c.step))
    if run_ids is not None:
        stmt = stmt.where(c.run_id.in_(run_ids))
    rows = conn.execute(stmt.group_by(c.run_id, c.status))
    out: dict[int, dict[str, tuple[int, int, int | None]]] = defaultdict(dict)
    for run_id, status, n, missing, top in rows:
        out[run_id][status] = (n, int(missing or 0), top)
    return out


def _last_final(counts: dict[str, tuple[int, int, int | None]]) -> int | None:
    tops = [counts[s][2] for s in _FINAL if s in counts and counts[s][2] is not None]
    return max(tops) if tops else None  # type: ignore[type-var]


def _last_finalised_at(conn: Connection, run_ids: list[int]) -> dict[int, float]:
    """When each run last finalised a step (``ix_steps_run_finalised``)."""
    c = STEPS.c
    stmt = select(c.run_id, func.max(c.finalised_at)).where(c.run_id.in_(run_ids))
    rows = conn.execute(stmt.group_by(c.run_id))
    return {run_id: at for run_id, at in rows if at is not None}


def summaries(conn: Connection, runs: list[RunRecord]) -> list[RunSummary]:
    ids = [run.id for run in runs]
    counts = _status_counts(conn, ids) if ids else {}
    last_at = _last_finalised_at(conn, ids) if ids else {}
    broken = _breach_counts(conn, [run.id for run in runs if run.spec.alerts])
    out = []
    for run in runs:
        mine = counts.get(run.id, {})
        n = {s.value: mine.get(s.value, (0, 0, None))[0] for s in StepStatus}
        out.append(
            RunSummary(
                run,
                _last_final(mine),
                n["open"],
                n["complete"],
                n["partial"],
                last_at.get(run.id),
                {r.name: broken.get((run.id, r.name), 0) for r in run.spec.alerts},
            )
        )
    return out


def snapshot(conn: Connection, runs: list[RunRecord]) -> list[RunSnapshot]:
    counts = _status_counts(conn)
    last = {run.id: _last_final(counts.get(run.id, {})) for run in runs}
    keys = sorted((i, s) for i, s in last.items() if s is not None)
    rows = {}
    if keys:
        stmt = select(STEPS.c.run_id, STEPS.c.status, STEPS.c.revision, STEPS.c.result).where(
            tuple_(STEPS.c.run_id, STEPS.c.step).in_(keys)
        )
        rows = {r.run_id: r for r in conn.execute(stmt)}
    last_at = _last_finalised_at(conn, [run.id for run in runs]) if runs else {}
    broken = _breach_counts(conn, [run.id for run in runs if run.spec.alerts])
    oldest = _oldest_open(conn)
    return [
        replace(
            _snapshot(run, last[run.id], rows.get(run.id), counts.get(run.id, {})),
            active_at=max(run.created_at, last_at.get(run.id, 0.0)),
            breaches={r.name: broken.get((run.id, r.name), 0) for r in run.spec.alerts},
            open_since=oldest.get(run.id, (None, None))[0],
            open_missing_ranks=oldest.get(run.id, (None, None))[1],
        )
        for run in runs
    ]


def _oldest_open(conn: Connection) -> dict[int, tuple[float, int]]:
    """Per run with open steps: its lowest open step's first sight and missing ranks
    (``ix_steps_run_status``)."""
    c = STEPS.c
    lowest = (
        select(c.run_id, func.min(c.step).label("step"))
        .where(c.status == StepStatus.OPEN.value)
        .group_by(c.run_id)
        .subquery()
    )
    rows = conn.execute(
        select(c.run_id, c.first_seen_at, c.missing_ranks).join(
            lowest, (c.run_id == lowest.c.run_id) & (c.step == lowest.c.step)
        )
    )
    return {run_id: (seen, missing) for run_id, seen, missing in rows}


def breaches(
    conn: Connection,
    run: RunRecord,
    start: int | None,
    end: int | None,
    rules: Sequence[str] | None,
    after: tuple[int, str] | None,
    limit: int,
) -> list[BreachRecord]:
    b = BREACHES.c
    stmt = select(b.step, b.rule, b.revision, b.finalised_at, b.breach).where(b.run_id == run.id)
    if start is not None:
        stmt = stmt.where(b.step >= start)
    if end is not None:
        stmt = stmt.where(b.step <= end)
    if rules is not None:
        stmt = stmt.where(b.rule.in_(list(rules)))
    if after is not None:
        stmt = stmt.where(tuple_(b.step, b.rule) > tuple_(*after))
    rows = conn.execute(stmt.order_by(b.step, b.rule).limit(limit))
    return [
        BreachRecord(step, rule, revision, at, orjson.loads(breach))
        for step, rule, revision, at, breach in rows
    ]


def _breach_counts(conn: Connection, run_ids: list[int]) -> dict[tuple[int, str], int]:
    """Steps that broke each (run, rule), for the runs ``run_ids`` (``ix_breaches_run_rule``)."""
    if not run_ids:
        return {}
    b = BREACHES.c
    rows = conn.execute(
        select(b.run_id, b.rule, func.count())
        .where(b.run_id.in_(run_ids))
        .group_by(b.run_id, b.rule)
    )
    return {(run_id, rule): n for run_id, rule, n in rows}


def _snapshot(
    run: RunRecord,
    step: int | None,
    row: Any,
    counts: dict[str, tuple[int, int, int | None]],
) -> RunSnapshot:
    values: dict[str, float | None] = {}
    if row is not None and row.result is not None:
        for name, m in orjson.loads(row.result)["metrics"].items():
            values[name] = shown_value(m["value"])
    partial = counts.get(StepStatus.PARTIAL.value, (0, 0, None))
    return RunSnapshot(
        run=run.name,
        world_size=run.world_size,
        last_step=step,
        last_status=None if row is None else StepStatus(row.status),
        last_revision=0 if row is None else row.revision,
        values=values,
        open_steps=counts.get(StepStatus.OPEN.value, (0, 0, None))[0],
        partial_steps=partial[0],
        missing_ranks=partial[1],
    )
