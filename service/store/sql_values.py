"""Writing a finalised step's per-metric values (``step_values``), in its own transaction.

Every finalisation writes one row per metric and derived value of the step; a later
finalisation of the same step (a higher revision) overwrites them, and a metric added
to the run since then gains its row. The generic path runs one ``executemany`` upsert;
PostgreSQL's pipelined path sends :data:`UPSERT_VALUES_PG` (arrays, fixed text) in the
round trip that commits.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Table
from sqlalchemy.dialects import postgresql, sqlite

from steptally.service.domain.finalise import StoredValue
from steptally.service.store.models import StepValue

STEP_VALUES: Table = StepValue.__table__  # type: ignore[assignment]

UPSERT_VALUES_PG = (
    "INSERT INTO step_values (run_id, col, step, value, state) "
    "SELECT %(run)s, * FROM unnest(%(cols)s::int[], %(steps)s::bigint[], "
    "%(values)s::float8[], %(states)s::smallint[]) "
    "ON CONFLICT (run_id, col, step) DO UPDATE SET value = excluded.value, state = excluded.state"
)


@functools.cache
def _upsert(dialect: str) -> Any:
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(STEP_VALUES)
    return stmt.on_conflict_do_update(
        index_elements=["run_id", "col", "step"],
        set_={"value": stmt.excluded.value, "state": stmt.excluded.state},
    )


def write_values(conn: Connection, run_id: int, values: Sequence[tuple[int, StoredValue]]) -> None:
    """Upsert ``(step, (col, value, state))`` rows of one run."""
    if values:
        rows = [
            {"run_id": run_id, "col": c, "step": s, "value": v, "state": st}
            for s, (c, v, st) in values
        ]
        conn.execute(_upsert(conn.dialect.name), rows)


def pg_params(run_id: int, values: Sequence[tuple[int, StoredValue]]) -> dict[str, Any]:
    """Parameters of :data:`UPSERT_VALUES_PG`."""
    return {
        "run": run_id,
        "cols": [c for _, (c, _, _) in values],
        "steps": [s for s, _ in values],
        "values": [v for _, (_, v, _) in values],
        "states": [st for _, (_, _, st) in values],
    }
