"""A pair's rows (``fragments``, ``commits``, ``partials``) without a foreign key to ``runs``.

Each of these rows made the database look its run up and lock it (``FOR KEY SHARE``)
as it was inserted, one query each: on PostgreSQL ~15 % of a group's CPU, 24 rows a
group of 8 reporter bodies (bench/README.md, Scale). Every transaction that writes
them adds to their steps' rows in the same transaction, and a step row keeps its
foreign key to ``runs``: a pair's rows are never written for a run that is not there.
Nothing in the service deletes a run; whoever deletes one by hand deletes its rows of
these tables too (``DELETE ... WHERE run_id = ...``), which the cascade did before.

SQLite names no constraint: its tables are rebuilt without it (batch mode).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("fragments", "commits", "partials")
#: how batch mode names SQLite's unnamed foreign keys, so that they can be dropped
NAMING = {"fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s"}


def upgrade() -> None:
    bind = op.get_bind()
    for table in TABLES:
        keys = sa.inspect(bind).get_foreign_keys(table)  # none: dropped already
        if bind.dialect.name == "sqlite" and keys:
            with op.batch_alter_table(table, naming_convention=NAMING) as batch:
                batch.drop_constraint(f"fk_{table}_run_id_runs", type_="foreignkey")
            continue
        for fk in keys:
            assert fk["name"] is not None  # PostgreSQL names every constraint
            op.drop_constraint(fk["name"], table, type_="foreignkey")


def downgrade() -> None:
    bind = op.get_bind()
    for table in TABLES:
        if bind.dialect.name == "sqlite":
            with op.batch_alter_table(table, naming_convention=NAMING) as batch:
                batch.create_foreign_key(
                    f"fk_{table}_run_id_runs", "runs", ["run_id"], ["id"], ondelete="CASCADE"
                )
            continue
        op.create_foreign_key(None, table, "runs", ["run_id"], ["id"], ondelete="CASCADE")
