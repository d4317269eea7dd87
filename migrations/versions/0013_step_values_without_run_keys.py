"""A step's values (``step_values``) without a foreign key to ``runs``.

A finalisation writes one row a value (33 for 32 metrics and a derived one), and each
row's check of its run (``SELECT … FROM runs … FOR KEY SHARE``, a trigger a row) cost
PostgreSQL ~6 µs: 33 rows inserted 2,000 times took 305–320 µs a step with the key
and 78–122 without (bench/README.md, Scale), about half of what a step's
finalisation costs the database. Values are written only in the transaction that
finalises their step, whose row in ``steps`` keeps its foreign key: no value is
written for a run that is not there. Nothing in the service deletes a run; whoever
deletes one by hand deletes its ``step_values`` too (``DELETE … WHERE run_id = …``),
which the cascade did before.

SQLite names no constraint and cannot drop one: the table is rebuilt as it is
(``WITHOUT ROWID``, its partial index) without the key, its rows copied.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "step_values"
ODD = "(state <> 0 OR value > 1e308 OR value < -1e308)"
COLUMNS = "run_id, col, step, value, state"


def upgrade() -> None:
    bind = op.get_bind()
    keys = sa.inspect(bind).get_foreign_keys(TABLE)  # none: dropped already
    if bind.dialect.name == "sqlite":
        if keys:
            _rebuild(with_key=False)
        return
    for fk in keys:
        assert fk["name"] is not None  # PostgreSQL names every constraint
        op.drop_constraint(fk["name"], TABLE, type_="foreignkey")


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _rebuild(with_key=True)
        return
    op.create_foreign_key(None, TABLE, "runs", ["run_id"], ["id"], ondelete="CASCADE")


def _rebuild(with_key: bool) -> None:
    """SQLite: the table made anew, with or without its key, and its rows copied."""
    new = f"{TABLE}_new"
    key = [sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE")]
    op.create_table(
        new,
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("col", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("step", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("value", sa.Double(), nullable=True),
        sa.Column("state", sa.SmallInteger(), nullable=False),
        *(key if with_key else []),
        sa.PrimaryKeyConstraint("run_id", "col", "step"),
        sqlite_with_rowid=False,
    )
    op.execute(f"INSERT INTO {new} ({COLUMNS}) SELECT {COLUMNS} FROM {TABLE}")
    op.drop_table(TABLE)  # its index with it
    op.rename_table(new, TABLE)
    op.create_index(
        "ix_step_values_odd", TABLE, ["run_id", "col", "step"], sqlite_where=sa.text(ODD)
    )
