"""Partial rows for every (step, rank) that has fragments.

Ingest reads a pair's partial row to learn whether the pair has fragments stored
(none: every fragment of the batch is new). Fragments stored before partial rows
existed (revision 0006) have none: each such pair gains a row that holds none of them
(no fragments, the empty state), so a finalisation of its step still reads the
fragments themselves (``load_live``), as it did.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

EMPTY_STATE = b"\x02\x00\x00"  # version 2, no entries (service/domain/partial.py)


def upgrade() -> None:
    op.get_bind().execute(
        sa.text(
            "INSERT INTO partials (run_id, step, rank, fragments, state) "
            "SELECT DISTINCT f.run_id, f.step, f.rank, 0, :empty FROM fragments AS f "
            "WHERE NOT EXISTS (SELECT 1 FROM partials AS p "
            "WHERE p.run_id = f.run_id AND p.step = f.step AND p.rank = f.rank)"
        ),
        {"empty": EMPTY_STATE},
    )


def downgrade() -> None:
    op.get_bind().execute(
        sa.text("DELETE FROM partials WHERE fragments = 0 AND state = :empty"),
        {"empty": EMPTY_STATE},
    )
