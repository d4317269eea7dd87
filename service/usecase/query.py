"""Read runs and steps as the REST contract shows them.

A finalised step is read from its stored result; an open step is evaluated on the
fly from its fragments so far, with ``status: "open"`` and revision 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from steptally.service.domain.finalise import StepResult, evaluate
from steptally.service.domain.progress import StepStatus
from steptally.service.domain.run import RunRecord
from steptally.service.errors import InvalidPayload, UnknownMetric, UnknownRun, UnknownStep
from steptally.service.store.base import RunSummary, StepRecord, Store

MAX_PAGE = 1000
MAX_SERIES = 100_000


def timestamp(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat()


def run_json(summary: RunSummary) -> dict[str, Any]:
    run = summary.run
    return {
        "name": run.name,
        "world_size": run.world_size,
        **run.spec.to_json(),
        "step_timeout_s": run.step_timeout_s,
        "created_at": timestamp(run.created_at),
        "last_finalised_step": summary.last_finalised_step,
        "steps": {"open": summary.open, "complete": summary.complete, "partial": summary.partial},
    }


def get_run(store: Store, name: str) -> dict[str, Any]:
    summary = store.run_summary(name)
    if summary is None:
        raise UnknownRun(f"no run is named {name!r}; GET /v1/runs lists the runs")
    return run_json(summary)


def list_runs(store: Store) -> dict[str, Any]:
    return {"runs": [run_json(s) for s in store.list_runs()]}


def _metric(result: StepResult, name: str) -> dict[str, Any]:
    found = result.metrics.get(name)
    if found is not None:
        return dict(found)
    reason = "the metric was added to the run after this step was finalised"
    return {"value": None, "reason": reason, "kind": None, "values": 0, "non_finite": 0}


def _result(run: RunRecord, record: StepRecord) -> StepResult:
    if record.result is not None:
        return record.result
    assert record.progress is not None, "an open step is read live"
    return evaluate(run, record.progress, record.fragments, StepStatus.OPEN)


def step_json(
    run: RunRecord, record: StepRecord, metrics: Sequence[str] | None = None
) -> dict[str, Any]:
    result = _result(run, record)
    names = metrics or run.spec.names()
    shown = {n: _metric(result, n) for n in names}
    return {
        "run": run.name,
        "step": record.step,
        "status": record.status.value,
        "revision": record.revision,
        "world_size": run.world_size,
        "ranks_committed": result.ranks_committed,
        "ranks_missing": result.ranks_missing,
        "fragments": {"received": result.received, "expected": result.expected},
        "missing_fragments": {str(r): n for r, n in result.missing_fragments.items()},
        "metrics": shown,
        "first_seen_at": timestamp(record.first_seen_at),
        "finalised_at": timestamp(record.finalised_at),
    }


def get_step(store: Store, run: RunRecord, step: int) -> dict[str, Any]:
    record = store.get_step(run, step)
    if record is None:
        raise UnknownStep(f"run {run.name!r} has no fragment or commit for step {step} yet")
    return step_json(run, record)


def _check_metrics(run: RunRecord, metrics: Sequence[str], where: str) -> None:
    known = set(run.spec.names())
    for name in metrics:
        if name not in known:
            raise UnknownMetric(f"run {run.name!r} has no metric {name!r}", where)


def list_steps(
    store: Store,
    run: RunRecord,
    start: int | None,
    end: int | None,
    metrics: Sequence[str],
    limit: int,
    cursor: str | None,
) -> dict[str, Any]:
    _check_metrics(run, metrics, "metric")
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidPayload(f"limit must be from 1 to {MAX_PAGE}", "limit")
    if cursor is not None:
        if not cursor.isdigit():
            raise InvalidPayload("cursor must be a next_cursor from an earlier page", "cursor")
        start = max(start or 0, int(cursor) + 1)
    records = store.list_steps(run, start, end, limit)
    page = [step_json(run, r, metrics) for r in records]
    more = len(records) == limit
    return {"steps": page, "next_cursor": str(records[-1].step) if more else None}


def series(
    store: Store, run: RunRecord, metric: str, start: int | None, end: int | None
) -> dict[str, Any]:
    _check_metrics(run, [metric], "metric")
    records = store.list_steps(run, start, end, MAX_SERIES)
    kind = run.spec.metrics.get(metric)
    values = [_metric(_result(run, r), metric)["value"] for r in records]
    return {
        "metric": metric,
        "kind": kind.value if kind is not None else "derived",
        "steps": [r.step for r in records],
        "values": values,
        "status": [r.status.value for r in records],
    }
