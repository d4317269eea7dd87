"""A covering index for the per-run status counts.

The runs list, a run's summary and every ``/metrics`` scrape count each run's steps
by status (with the missing ranks and the highest step). Without an index that holds
those columns, each count reads every step row, result column and all: about 200 ms
for a run of 100,000 steps on SQLite, per request and per scrape.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_steps_run_status", "steps", ["run_id", "status", "step", "missing_ranks"])


def downgrade() -> None:
    op.drop_index("ix_steps_run_status", table_name="steps")
