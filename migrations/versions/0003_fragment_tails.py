"""Exact sum fragments: the further terms of each fragment's expansions.

``fragments.tails`` holds, for the columns whose value is an exact sum of more than
one term, the terms after the first (see ``steptally.service.domain.packing``); NULL for
every fragment stored before, whose values are one term each.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("fragments") as batch:
        batch.add_column(sa.Column("tails", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("fragments") as batch:
        batch.drop_column("tails")
