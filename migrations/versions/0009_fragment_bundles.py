"""Fragment bundles: a fragments row may hold several fragments of one (step, rank).

``seqs`` (null: the row is the one fragment ``seq``, as every row before) lists a
bundle's seqs; see ``service/store/models.py``.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("fragments", sa.Column("seqs", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    bundles = (
        op.get_bind()
        .execute(sa.text("SELECT count(*) FROM fragments WHERE seqs IS NOT NULL"))
        .scalar_one()
    )
    if bundles:
        raise RuntimeError(
            f"{bundles} fragments rows hold bundles, which revision 0008 cannot read: "
            "downgrading would lose fragments"
        )
    op.drop_column("fragments", "seqs")
