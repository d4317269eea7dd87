"""Initial schema: runs, their metric columns, steps, commits and fragments.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _run_fk() -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE")


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("spec", sa.Text(), nullable=False),
        sa.Column("step_timeout_s", sa.Double(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "metrics",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("col", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        _run_fk(),
        sa.PrimaryKeyConstraint("run_id", "col"),
    )
    op.create_index("ix_metrics_run_name", "metrics", ["run_id", "name"], unique=True)
    op.create_table(
        "steps",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("committed_ranks", sa.Integer(), nullable=False),
        sa.Column("expected", sa.BigInteger(), nullable=False),
        sa.Column("received", sa.BigInteger(), nullable=False),
        sa.Column("missing_ranks", sa.Integer(), nullable=False),
        sa.Column("first_seen_at", sa.Double(), nullable=False),
        sa.Column("deadline", sa.Double(), nullable=False),
        sa.Column("finalised_at", sa.Double(), nullable=True),
        sa.Column("result", sa.Text(), nullable=True),
        _run_fk(),
        sa.PrimaryKeyConstraint("run_id", "step"),
    )
    op.create_index("ix_steps_status_deadline", "steps", ["status", "deadline"], unique=False)
    op.create_table(
        "commits",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("rank", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("fragments", sa.BigInteger(), nullable=False),
        _run_fk(),
        sa.PrimaryKeyConstraint("run_id", "step", "rank"),
    )
    op.create_table(
        "fragments",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("rank", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("seq", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("values_f64", sa.LargeBinary(), nullable=False),
        sa.Column("present", sa.LargeBinary(), nullable=True),
        _run_fk(),
        sa.PrimaryKeyConstraint("run_id", "step", "rank", "seq"),
    )


def downgrade() -> None:
    op.drop_table("fragments")
    op.drop_table("commits")
    op.drop_index("ix_steps_status_deadline", table_name="steps")
    op.drop_table("steps")
    op.drop_index("ix_metrics_run_name", table_name="metrics")
    op.drop_table("metrics")
    op.drop_table("runs")
