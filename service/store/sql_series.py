"""One metric's finalised values over a range of steps, downsampled in SQL.

Downsampling splits the range's steps into ``points // 2`` equal buckets of step
numbers and keeps, in each bucket, the step with the smallest and the step with the
largest finite value (the earliest such step on ties): one ``GROUP BY`` finds each
bucket's extremes and its first and last step, then a short range read inside the
bucket finds the steps that hold them (PostgreSQL does both in the one ``GROUP BY``,
over arrays). Every step that a plot must never lose is kept besides: each partial
or revised step and each NaN, infinite or undefined value (partial indexes find both
without a scan). One statement does it all, and only the kept rows, with their
status and revision, leave the database.

Measured by ``bench/series.py``: about 60 ms for 100,000 steps on either database.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Connection, and_, func, select, text

from steptally.service.domain.finalise import ValueState
from steptally.service.domain.progress import StepStatus
from steptally.service.store.models import ODD, REVISED
from steptally.service.store.protocol import SeriesRows
from steptally.service.store.sql_statement import STEP_VALUES, STEPS

SV = STEP_VALUES.c


Downsample = Callable[[Connection, dict[str, Any], list[Any]], tuple[Sequence[Any], int]]


def read_series(
    conn: Connection,
    downsample: Downsample,
    run_id: int,
    col: int,
    start: int | None,
    end: int | None,
    points: int | None,
) -> SeriesRows:
    """The series of column ``col``; downsampled when it holds more than ``points`` steps."""
    in_range = _in_range(run_id, col, start, end)
    lo, hi = conn.execute(
        select(  # two index seeks
            select(func.min(SV.step)).where(*in_range).scalar_subquery(),
            select(func.max(SV.step)).where(*in_range).scalar_subquery(),
        )
    ).one()
    if lo is None:
        return _rows([], 0, False)
    if points is not None and hi - lo + 1 > points:
        params = {"run": run_id, "col": col, "lo": lo, "hi": hi, "buckets": max(1, points // 2)}
        rows, total = downsample(conn, {**params, "span": hi - lo + 1}, in_range)
        if total > points:
            return _rows(rows, total, True)
    stmt = (
        select(SV.step, SV.value, SV.state, STEPS.c.status, STEPS.c.revision)
        .join(STEPS, and_(STEPS.c.run_id == SV.run_id, STEPS.c.step == SV.step))
        .where(*in_range)
        .order_by(SV.step)
    )
    rows = conn.execute(stmt).all()
    return _rows(rows, len(rows), False)


def downsampled(
    conn: Connection, params: dict[str, Any], in_range: list[Any]
) -> tuple[Sequence[Any], int]:
    """The kept rows and the number of finalised steps in the range (SQLite)."""
    total = conn.execute(select(func.count()).where(*in_range)).scalar_one()
    return conn.execute(_DOWNSAMPLED, params).all(), total


def downsampled_pg(
    conn: Connection, params: dict[str, Any], in_range: list[Any]
) -> tuple[Sequence[Any], int]:
    """:func:`downsampled` on PostgreSQL, in one pass over arrays."""
    for setting in _PG_SETTINGS:  # until the end of this read's transaction
        conn.exec_driver_sql(setting)
    rows = conn.execute(_DOWNSAMPLED_PG, params).all()
    return rows, int(rows[0].total) if rows else 0


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
  GROUP BY (step - :lo) * :buckets / :span
  LIMIT :buckets),  -- never fewer: the LIMIT tells PostgreSQL's planner how many
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

# the planner cannot know the buckets are few: without room for a hash table it
# sorts the whole range; parallel workers only add start-up time to a short scan; and
# a merge join would read the whole range again to join the kept steps
_PG_SETTINGS = (
    "SET LOCAL work_mem = '64MB'",
    "SET LOCAL max_parallel_workers_per_gather = 0",
    "SET LOCAL enable_mergejoin = off",
)

# PostgreSQL finds each bucket's extreme and its step in one pass: the least array
# [value, step] is the least value at its earliest step, the greatest [value, -step]
# the greatest value at its earliest step (steps are exact in float64 below 2**53)
_DOWNSAMPLED_PG = text(f"""
WITH extremes AS (
  SELECT min(ARRAY[value, step::float8]) AS low, max(ARRAY[value, -step::float8]) AS high,
         count(*) AS n
  FROM step_values WHERE {_RANGE} AND NOT {ODD}
  GROUP BY (step - :lo) * :buckets / :span
  LIMIT :buckets),
odd AS (SELECT step FROM step_values WHERE {_RANGE} AND {ODD}),
kept AS (
  SELECT low[2]::bigint AS step FROM extremes
  UNION SELECT (-high[2])::bigint FROM extremes
  UNION SELECT step FROM odd
  UNION SELECT step FROM steps WHERE run_id = :run AND step BETWEEN :lo AND :hi AND {REVISED})
SELECT sv.step, sv.value, sv.state, st.status, st.revision,
       (SELECT sum(n) FROM extremes) + (SELECT count(*) FROM odd) AS total
FROM kept JOIN step_values sv ON sv.run_id = :run AND sv.col = :col AND sv.step = kept.step
JOIN steps st ON st.run_id = :run AND st.step = kept.step
ORDER BY sv.step
""")
