"""One metric's finalised values over a range of steps, downsampled in SQL.

Downsampling splits the range's steps into ``points // 2`` equal buckets of step
numbers and keeps, in each bucket, the step with the smallest and the step with the
largest finite value (the earliest such step on ties): one ``GROUP BY`` finds each
bucket's extremes and its first and last step, then a short range read inside the
bucket finds the steps that hold them. Every step that a plot must never lose is
kept besides: each partial or revised step and each NaN, infinite or undefined value
(partial indexes find both without a scan). Only the kept rows leave the database;
the kept steps come back once to select them with their status and revision.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, and_, func, select, text

from steptally.service.domain.finalise import ValueState
from steptally.service.domain.progress import StepStatus
from steptally.service.store.base import SeriesRows
from steptally.service.store.models import ODD, REVISED
from steptally.service.store.sql_statement import STEPS
from steptally.service.store.sql_values import STEP_VALUES

SV = STEP_VALUES.c


def read_series(
    conn: Connection, run_id: int, col: int, start: int | None, end: int | None, points: int | None
) -> SeriesRows:
    """The series of column ``col``; downsampled when it holds more than ``points`` steps."""
    in_range = _in_range(run_id, col, start, end)
    total, lo, hi = conn.execute(
        select(func.count(), func.min(SV.step), func.max(SV.step)).where(*in_range)
    ).one()
    if points is not None and total > points:
        buckets = max(1, points // 2)
        params = {"run": run_id, "col": col, "lo": lo, "hi": hi, "buckets": buckets}
        rows = conn.execute(_DOWNSAMPLED, {**params, "span": hi - lo + 1}).all()
        return _rows(rows, total, True)
    stmt = (
        select(SV.step, SV.value, SV.state, STEPS.c.status, STEPS.c.revision)
        .join(STEPS, and_(STEPS.c.run_id == SV.run_id, STEPS.c.step == SV.step))
        .where(*in_range)
        .order_by(SV.step)
    )
    return _rows(conn.execute(stmt).all(), total, False)


def _rows(rows: Sequence[Any], total: int, downsampled: bool) -> SeriesRows:
    return SeriesRows(
        total=total,
        downsampled=downsampled,
        steps=[r.step for r in rows],
        values=[r.value for r in rows],
        states=[ValueState(r.state) for r in rows],
        status=[StepStatus(r.status) for r in rows],
        revision=[r.revision for r in rows],
    )


def _in_range(run_id: int, col: int, start: int | None, end: int | None) -> list[Any]:
    where: list[Any] = [SV.run_id == run_id, SV.col == col]
    if start is not None:
        where.append(SV.step >= start)
    if end is not None:
        where.append(SV.step <= end)
    return where


_RANGE = "run_id = :run AND col = :col AND step BETWEEN :lo AND :hi"
_AT = (
    "(SELECT min(v.step) FROM step_values v WHERE v.run_id = :run AND v.col = :col "
    "AND v.step BETWEEN e.first AND e.last AND v.value = e.{}) FROM extremes e"
)
_DOWNSAMPLED = text(f"""
WITH extremes AS (
  SELECT min(step) AS first, max(step) AS last, min(value) AS low, max(value) AS high
  FROM step_values WHERE {_RANGE} AND NOT {ODD}
  GROUP BY (step - :lo) * :buckets / :span),
kept AS (
  SELECT {_AT.format("low")}
  UNION SELECT {_AT.format("high")}
  UNION SELECT step FROM step_values WHERE {_RANGE} AND {ODD}
  UNION SELECT step FROM steps WHERE run_id = :run AND step BETWEEN :lo AND :hi AND {REVISED})
SELECT sv.step, sv.value, sv.state, st.status, st.revision
FROM step_values sv JOIN steps st ON st.run_id = sv.run_id AND st.step = sv.step
WHERE sv.run_id = :run AND sv.col = :col AND sv.step IN (SELECT * FROM kept)
ORDER BY sv.step
""")
