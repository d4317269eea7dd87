"""Stored per-step values, derived columns, and the indexes of series and events.

``step_values`` holds one row per finalised step and metric (derived values
included, under negative ``metrics.col``); existing runs get their derived columns
and existing finalised steps their values from the stored results.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

REVISED = "(status = 'partial' OR revision > 1)"
ODD = "(state <> 0 OR value > 1e308 OR value < -1e308)"
_NON_FINITE = {"Infinity": (math.inf, 0), "-Infinity": (-math.inf, 0), "NaN": (None, 1)}


def upgrade() -> None:
    op.create_table(
        "step_values",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("col", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("step", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("value", sa.Double(), nullable=True),
        sa.Column("state", sa.SmallInteger(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "col", "step", postgresql_include=["value", "state"]),
        sqlite_with_rowid=False,
    )
    op.create_index(
        "ix_step_values_odd",
        "step_values",
        ["run_id", "col", "step"],
        sqlite_where=sa.text(ODD),
        postgresql_where=sa.text(ODD),
    )
    op.create_index("ix_steps_run_finalised", "steps", ["run_id", "finalised_at", "step"])
    op.create_index(
        "ix_steps_run_revised",
        "steps",
        ["run_id", "step"],
        sqlite_where=sa.text(REVISED),
        postgresql_where=sa.text(REVISED),
    )
    _backfill(op.get_bind())


def downgrade() -> None:
    op.drop_index("ix_steps_run_revised", table_name="steps")
    op.drop_index("ix_steps_run_finalised", table_name="steps")
    op.drop_index("ix_step_values_odd", table_name="step_values")
    op.drop_table("step_values")
    op.execute("DELETE FROM metrics WHERE col < 0")


def _backfill(conn: sa.Connection) -> None:
    for run_id, spec in conn.execute(sa.text("SELECT id, spec FROM runs")).all():
        derived = list(json.loads(spec).get("derived", {}))
        if derived:
            conn.execute(
                sa.text("INSERT INTO metrics (run_id, col, name) VALUES (:run, :col, :name)"),
                [{"run": run_id, "col": -1 - i, "name": n} for i, n in enumerate(derived)],
            )
        names = sa.text("SELECT name, col FROM metrics WHERE run_id = :run")
        cols: dict[str, int] = {n: c for n, c in conn.execute(names, {"run": run_id})}
        _backfill_run(conn, run_id, cols)


def _backfill_run(conn: sa.Connection, run_id: int, cols: dict[str, int]) -> None:
    stored = conn.execute(
        sa.text("SELECT step, result FROM steps WHERE run_id = :run AND result IS NOT NULL"),
        {"run": run_id},
    )
    rows: list[dict[str, Any]] = []
    for step, result in stored:
        for name, metric in json.loads(result)["metrics"].items():
            if name in cols:
                value, state = _value(metric["value"])
                rows.append(
                    {"run": run_id, "col": cols[name], "step": step, "value": value, "state": state}
                )
    if rows:
        conn.execute(
            sa.text(
                "INSERT INTO step_values (run_id, col, step, value, state) "
                "VALUES (:run, :col, :step, :value, :state)"
            ),
            rows,
        )


def _value(value: Any) -> tuple[float | None, int]:
    if value is None:
        return None, 2
    if isinstance(value, str):
        return _NON_FINITE[value]
    return float(value), 0
