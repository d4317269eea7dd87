"""Runs and their metric column index in SQL."""

from __future__ import annotations

from typing import Any

import orjson
from sqlalchemy import Connection, Row, Table, insert, select, update

from steptally.client.algebra import MetricSpec
from steptally.service.domain.run import RunRecord
from steptally.service.store.base import RunDraft
from steptally.service.store.models import Metric, Run

RUNS: Table = Run.__table__  # type: ignore[assignment]
METRICS: Table = Metric.__table__  # type: ignore[assignment]


def load_run(
    conn: Connection, *, name: str | None = None, run_id: int | None = None, lock: bool = False
) -> RunRecord | None:
    """The run with ``name`` or ``run_id``; ``lock`` holds its row until the transaction ends."""
    stmt = select(RUNS)
    stmt = stmt.where(RUNS.c.name == name) if name is not None else stmt.where(RUNS.c.id == run_id)
    if lock and conn.dialect.name == "postgresql":
        stmt = stmt.with_for_update()
    row = conn.execute(stmt).first()
    if row is None:
        return None
    return _record(row, _columns(conn, [row.id])[row.id])


def load_runs(conn: Connection) -> list[RunRecord]:
    rows = conn.execute(select(RUNS).order_by(RUNS.c.name)).all()
    columns = _columns(conn, [r.id for r in rows])
    return [_record(r, columns[r.id]) for r in rows]


def _columns(conn: Connection, run_ids: list[int]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {i: [] for i in run_ids}
    if run_ids:
        rows = conn.execute(
            select(METRICS.c.run_id, METRICS.c.name)
            .where(METRICS.c.run_id.in_(run_ids))
            .order_by(METRICS.c.run_id, METRICS.c.col)
        )
        for run_id, name in rows:
            out[run_id].append(name)
    return out


def _record(row: Row[Any], columns: list[str]) -> RunRecord:
    return RunRecord(
        id=row.id,
        name=row.name,
        world_size=row.world_size,
        spec=MetricSpec.from_json(orjson.loads(row.spec)),
        step_timeout_s=row.step_timeout_s,
        created_at=row.created_at,
        columns=tuple(columns),
    )


def save_run(
    conn: Connection, existing: RunRecord | None, name: str, draft: RunDraft, now: float
) -> RunRecord:
    """Insert or update a run; metrics new to it get the next columns."""
    spec_json = orjson.dumps(draft.spec.to_json()).decode()
    fields = {
        "world_size": draft.world_size,
        "spec": spec_json,
        "step_timeout_s": draft.step_timeout_s,
    }
    if existing is None:
        run_id = conn.execute(
            insert(RUNS).values(name=name, created_at=now, **fields).returning(RUNS.c.id)
        ).scalar_one()
        known: tuple[str, ...] = ()
    else:
        run_id = existing.id
        conn.execute(update(RUNS).where(RUNS.c.id == run_id).values(**fields))
        known = existing.columns
    added = [n for n in draft.spec.metrics if n not in known]
    if added:
        conn.execute(
            insert(METRICS),
            [{"run_id": run_id, "col": len(known) + i, "name": n} for i, n in enumerate(added)],
        )
    run = load_run(conn, run_id=run_id)
    assert run is not None
    return run
