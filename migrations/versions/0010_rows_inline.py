"""PostgreSQL keeps fragment bundles and partial states in their rows.

A reporter's body is one bundle of its microbatches' fragments (8 × 32 float64: 2 KB)
and one partial state (~1.4 KB). PostgreSQL moves a row's wide values out of line into
its TOAST table once the row passes ~2 KB (``toast_tuple_target``'s default), after
trying to compress them (a float64 column barely compresses): every bundle cost a
second row and a second index entry in the TOAST table, and the compression attempt.
With ``toast_tuple_target = 8160`` (the most a row of an 8 kB page holds) a row up to
that size stays as it is; a wider one is moved out of line as before. Inserting 2 kB
bundles costs 11 µs a row instead of 22 (bench/README.md, Scale). It applies to rows
written from now on. SQLite: nothing to do.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("fragments", "partials")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in TABLES:
        op.execute(f"ALTER TABLE {table} SET (toast_tuple_target = 8160)")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in TABLES:
        op.execute(f"ALTER TABLE {table} RESET (toast_tuple_target)")
