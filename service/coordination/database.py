"""What coordination reads from the database beside the SQL store's own reads.

* :func:`open_commits`: every commit of every open step, to rebuild the progress in
  Redis (:mod:`.progress`) after a wipe or restart;
* :func:`open_live`: the fragments of some open steps of a run, with the step rows'
  counters read in the same transaction, to evaluate those steps with their commits
  from Redis: one query for all of them, where the SQL store reads commits and
  fragments step by step;
* :func:`step_live`: one open step's commits and fragments, when Redis cannot say.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from sqlalchemy import Engine, select

from steptally.service.coordination.progress import OpenCommit, run_key
from steptally.service.domain.packing import Cell, unbundled
from steptally.service.domain.progress import Progress, StepStatus
from steptally.service.domain.run import RunRecord
from steptally.service.store.engine import transaction
from steptally.service.store.sql_run import RUNS
from steptally.service.store.sql_statement import COMMITS, FRAGMENTS, STEPS
from steptally.service.store.sql_step import FRAGMENT_CELLS, load_live


@dataclass(slots=True)
class Live:
    """An open step's fragments, what arrived per rank, and its row's counters
    ``(ranks committed, fragments expected)`` (None: the row is gone)."""

    cells: list[Cell] = field(default_factory=list)
    received: Counter[int] = field(default_factory=Counter)
    counters: tuple[int, int] | None = None


def open_commits(engine: Engine) -> Iterator[OpenCommit]:
    """Every commit of every open step, in step order, read in one transaction."""
    c, s, r = COMMITS.c, STEPS.c, RUNS.c
    stmt = (
        select(c.run_id, r.created_at, c.step, c.rank, c.fragments, s.deadline)
        .join(STEPS, (s.run_id == c.run_id) & (s.step == c.step))
        .join(RUNS, r.id == c.run_id)
        .where(s.status == StepStatus.OPEN.value)
        .order_by(c.run_id, c.step)
    )
    with transaction(engine, write=False) as conn:
        rows = conn.execute(stmt).all()
    for run_id, created_at, step, rank, declared, deadline in rows:
        run = run_key(int(run_id), float(created_at))
        yield OpenCommit(run, int(step), int(rank), int(declared), float(deadline))


def open_live(
    engine: Engine, run: RunRecord, steps: Sequence[int], counters: bool
) -> dict[int, Live]:
    """The fragments of ``steps`` of ``run`` and, with ``counters``, the step rows'
    counters, read first, in one transaction."""
    out: dict[int, Live] = defaultdict(Live)
    if not steps:
        return out
    s, f = STEPS.c, FRAGMENTS.c
    fragments = select(f.step, f.rank, *FRAGMENT_CELLS).where(f.run_id == run.id, f.step.in_(steps))
    with transaction(engine, write=False) as conn:
        if counters:
            rows = conn.execute(
                select(s.step, s.committed_ranks, s.expected).where(
                    s.run_id == run.id, s.step.in_(steps)
                )
            )
            for step, committed, expected in rows:
                out[step].counters = (committed, expected)
        for step, rank, *row in conn.execute(fragments):
            live = out[step]
            cells = unbundled(*row)
            live.cells.extend(cell for _, cell in cells)
            live.received[rank] += len(cells)
    return out


def step_live(engine: Engine, run: RunRecord, step: int) -> tuple[Progress, list[Cell]]:
    """One step's progress and fragments from the database alone."""
    with transaction(engine, write=False) as conn:
        return load_live(conn, run, step)
