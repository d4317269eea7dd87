"""PostgreSQL: ``steptally_refuse(reason)``, which ends a statement with an error.

A reporter's group is written by one statement that takes nothing stored of its pairs
and none of its steps finalised for granted (``service/store/sql_statement.py``,
``fresh_plain``): a pair stored already breaks the key of its ``commits`` or
``partials`` row, and a finalised step, whose row that statement then leaves as it
is, makes it call this function. Either way the statement fails, its transaction
writes nothing, and the writer stores the group the general way, which says what the
batch is (duplicates, a conflict, a late rank). The error's SQLSTATE is ``ST001``
(``REFUSED`` in ``service/store/sql_postgres.py``). SQLite: nothing to do.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        "CREATE OR REPLACE FUNCTION steptally_refuse(reason TEXT) RETURNS BOOLEAN "
        "LANGUAGE plpgsql VOLATILE AS $$ "
        "BEGIN RAISE EXCEPTION USING ERRCODE = 'ST001', MESSAGE = reason; END $$"
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP FUNCTION steptally_refuse(TEXT)")
