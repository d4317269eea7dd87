"""Breaches: the steps that broke an alert rule of their run, one row per (step, rule).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "breaches",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("rule", sa.String(128), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("finalised_at", sa.Double(), nullable=False),
        sa.Column("breach", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "step", "rule"),
    )
    op.create_index("ix_breaches_run_rule", "breaches", ["run_id", "rule"])


def downgrade() -> None:
    op.drop_index("ix_breaches_run_rule", table_name="breaches")
    op.drop_table("breaches")
