"""The hot path's SQL statements, built once per dialect and reused.

Reusing one statement object keeps SQLAlchemy's compile cache warm and saves
building expressions on every request; sets of steps and ranks are ``IN``
lists of expanding parameters (``:steps``, ``:ranks``), filtered exactly in Python.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Table, bindparam, func, select, update
from sqlalchemy.dialects import postgresql, sqlite

from steptally.service.store.models import Commit, Fragment, Step

STEPS: Table = Step.__table__  # type: ignore[assignment]
COMMITS: Table = Commit.__table__  # type: ignore[assignment]
FRAGMENTS: Table = Fragment.__table__  # type: ignore[assignment]
STEP_FIELDS = (
    "status", "revision", "committed_ranks", "expected", "received", "missing_ranks",
    "finalised_at", "result",
)  # fmt: skip
# every column of a step row but run_id, each an attribute of StepState
STATE_COLUMNS = tuple(c.name for c in STEPS.c if c.name != "run_id")


@dataclass(frozen=True)
class Statements:
    upsert_steps: Any  # creates missing step rows, returns (and on PostgreSQL locks) all
    insert_fragments: Any
    insert_commits: Any
    update_steps: Any
    commits_of: Any  # (step, rank, fragments) for :run, :steps, :ranks
    max_seq_of: Any  # (step, rank, max seq) for :run, :steps, :ranks
    fragments_of: Any  # (step, rank, seq, values, present, tails) for :run, :steps, :ranks


def _where(table: Table) -> Any:
    return (
        table.c.run_id == bindparam("run"),
        table.c.step.in_(bindparam("steps", expanding=True)),
        table.c.rank.in_(bindparam("ranks", expanding=True)),
    )


@functools.cache
def statements(dialect: str) -> Statements:
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    up = insert(STEPS)
    upsert = up.on_conflict_do_update(
        index_elements=["run_id", "step"], set_={"status": STEPS.c.status}
    ).returning(*STEPS.c)
    f, c = FRAGMENTS.c, COMMITS.c
    return Statements(
        upsert_steps=upsert,
        insert_fragments=insert(FRAGMENTS)
        .on_conflict_do_nothing()
        .returning(f.step, f.rank, f.seq),
        insert_commits=insert(COMMITS).on_conflict_do_nothing().returning(c.step, c.rank),
        update_steps=update(STEPS)
        .where(STEPS.c.run_id == bindparam("k_run"), STEPS.c.step == bindparam("k_step"))
        .values({name: bindparam(f"v_{name}") for name in STEP_FIELDS}),
        commits_of=select(c.step, c.rank, c.fragments).where(*_where(COMMITS)),
        max_seq_of=select(f.step, f.rank, func.max(f.seq))
        .where(*_where(FRAGMENTS))
        .group_by(f.step, f.rank),
        fragments_of=select(f.step, f.rank, f.seq, f.values_f64, f.present, f.tails).where(
            *_where(FRAGMENTS)
        ),
    )


def keys_params(run_id: int, keys: Any) -> dict[str, Any]:
    """Parameters selecting the steps and ranks of ``keys`` (tuples starting step, rank)."""
    keys = list(keys)
    return {
        "run": run_id,
        "steps": sorted({k[0] for k in keys}),
        "ranks": sorted({k[1] for k in keys}),
    }
