"""Runs and their metric column index in SQL.

``metrics.col`` is a metric's position in a fragment's blob (0, 1, …, append-only);
a derived value gets a negative column (-1, -2, …, append-only) so that its stored
per-step values (``step_values.col``) resolve to a name through the same table.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import orjson
from sqlalchemy import Connection, Row, Select, Table, bindparam, func, insert, select, update

from steptally.client.algebra import MetricSpec
from steptally.service.domain.run import RunDraft, RunRecord
from steptally.service.store.models import Metric, Run

RUNS: Table = Run.__table__  # type: ignore[assignment]
METRICS: Table = Metric.__table__  # type: ignore[assignment]


def load_run(
    conn: Connection,
    *,
    name: str | None = None,
    run_id: int | None = None,
    lock: Callable[[Select[Any]], Select[Any]] | None = None,
) -> RunRecord | None:
    """The run with ``name`` or ``run_id``; ``lock`` (the dialect's ``for_update``)
    holds its row until the transaction ends."""
    stmt = select(RUNS)
    stmt = stmt.where(RUNS.c.name == name) if name is not None else stmt.where(RUNS.c.id == run_id)
    if lock is not None:
        stmt = lock(stmt)
    row = conn.execute(stmt).first()
    if row is None:
        return None
    return _record(row, _columns(conn, [row.id])[row.id])


# what of a run can change, in one statement built once
_CURRENT = select(
    RUNS.c.spec,
    RUNS.c.world_size,
    RUNS.c.step_timeout_s,
    select(func.count()).where(METRICS.c.run_id == bindparam("run")).scalar_subquery(),
).where(RUNS.c.id == bindparam("run"))


def read_run_key(conn: Connection, run_id: int) -> tuple[Any, ...] | None:
    """What of a run can change, as :class:`KnownRuns` compares it; None: no such run."""
    row = conn.execute(_CURRENT, {"run": run_id}).first()
    return None if row is None else tuple(row)


class KnownRuns:
    """Runs as a store last read them, by id. :meth:`current` is given what of a run can
    change (its spec's text, its number of metric columns; one small statement) and
    parses the spec again only when that changed: a finalisation wants the run as it
    stands, and parsing it cost most of a millisecond a step."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[tuple[Any, ...], RunRecord]] = {}
        self._lock = threading.Lock()

    def known(self, run_id: int) -> tuple[tuple[Any, ...], RunRecord] | None:
        """The run as last read and what of it could change then (its key), if read."""
        with self._lock:
            return self._known.get(run_id)

    def current(self, conn: Connection, run_id: int, key: tuple[Any, ...]) -> RunRecord | None:
        """The run as it stands; ``key``: what of it can change, read in the same
        transaction (a dialect's ``run_key``, or its ``lock_steps`` bringing it)."""
        with self._lock:
            known = self._known.get(run_id)
        if known is not None and known[0] == key:
            return known[1]
        run = load_run(conn, run_id=run_id)
        if run is not None:
            with self._lock:
                self._known[run_id] = (key, run)
        return run


def load_runs(
    conn: Connection, after: str | None = None, limit: int | None = None
) -> list[RunRecord]:
    """Runs in name order, named after ``after`` (None: from the first), ``limit`` at most."""
    stmt = select(RUNS).order_by(RUNS.c.name)
    if after is not None:
        stmt = stmt.where(RUNS.c.name > after)
    rows = conn.execute(stmt.limit(limit)).all()
    columns = _columns(conn, [r.id for r in rows])
    return [_record(r, columns[r.id]) for r in rows]


def _columns(conn: Connection, run_ids: list[int]) -> dict[int, tuple[list[str], list[str]]]:
    """Per run: the fragment columns (col 0, 1, …) and the derived ones (col -1, -2, …)."""
    out: dict[int, tuple[list[str], list[str]]] = {i: ([], []) for i in run_ids}
    if run_ids:
        rows = conn.execute(
            select(METRICS.c.run_id, METRICS.c.col, METRICS.c.name)
            .where(METRICS.c.run_id.in_(run_ids))
            .order_by(METRICS.c.run_id, func.abs(METRICS.c.col))
        )
        for run_id, col, name in rows:
            out[run_id][0 if col >= 0 else 1].append(name)
    return out


def _record(row: Row[Any], columns: tuple[list[str], list[str]]) -> RunRecord:
    return RunRecord(
        id=row.id,
        name=row.name,
        world_size=row.world_size,
        spec=MetricSpec.from_json(orjson.loads(row.spec)),
        step_timeout_s=row.step_timeout_s,
        created_at=row.created_at,
        columns=tuple(columns[0]),
        derived_columns=tuple(columns[1]),
    )


def save_run(
    conn: Connection, existing: RunRecord | None, name: str, draft: RunDraft, now: float
) -> RunRecord:
    """Insert or update a run; metrics new to it get the next columns."""
    spec_json = orjson.dumps(draft.spec.to_json()).decode()
    fields = {
        "world_size": draft.world_size,
        "spec": spec_json,
        "step_timeout_s": draft.step_timeout_s,
    }
    if existing is None:
        run_id = conn.execute(
            insert(RUNS).values(name=name, created_at=now, **fields).returning(RUNS.c.id)
        ).scalar_one()
        known: tuple[str, ...] = ()
        known_derived: tuple[str, ...] = ()
    else:
        run_id = existing.id
        conn.execute(update(RUNS).where(RUNS.c.id == run_id).values(**fields))
        known, known_derived = existing.columns, existing.derived_columns
    added = [n for n in draft.spec.metrics if n not in known]
    derived = [n for n in draft.spec.derived if n not in known_derived]
    rows = [{"run_id": run_id, "col": len(known) + i, "name": n} for i, n in enumerate(added)]
    rows += [
        {"run_id": run_id, "col": -1 - len(known_derived) - i, "name": n}
        for i, n in enumerate(derived)
    ]
    if rows:
        conn.execute(insert(METRICS), rows)
    run = load_run(conn, run_id=run_id)
    assert run is not None
    return run
