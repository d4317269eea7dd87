"""Read runs, steps and series as the REST contract shows them.

A finalised step is read from its stored result; an open step is evaluated on the
fly from its fragments so far, with ``status: "open"`` and revision 0. A series
holds finalised steps only, read from their stored per-metric values.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from steptally.client.wire import encode_number
from steptally.service.domain.finalise import StepResult, ValueState, evaluate
from steptally.service.domain.limits import MAX_INT, brief
from steptally.service.domain.progress import StepStatus
from steptally.service.domain.run import RunRecord, RunSummary, is_run_name
from steptally.service.errors import (
    InvalidPayload,
    MetricNotFound,
    RuleNotFound,
    UnknownRun,
    UnknownStep,
)
from steptally.service.store.protocol import BreachRecord, StepRecord, Store

MAX_PAGE = 1000
MAX_SERIES = 100_000  # a series without ``points`` is downsampled past this many steps
MIN_POINTS, MAX_POINTS = 2, 10_000
_NO_COLUMN = -(2**31)
_STEP_CURSOR = re.compile(r"[0-9]{1,19}")


def timestamp(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat()


def run_json(summary: RunSummary) -> dict[str, Any]:
    run = summary.run
    return {
        "name": run.name,
        "world_size": run.world_size,
        **run.spec.to_json(),
        "alerts": [rule.to_json() for rule in run.spec.alerts],
        "step_timeout_s": run.step_timeout_s,
        "created_at": timestamp(run.created_at),
        "last_finalised_step": summary.last_finalised_step,
        "last_finalised_at": timestamp(summary.last_finalised_at),
        "steps": {"open": summary.open, "complete": summary.complete, "partial": summary.partial},
        "breaches": dict(summary.breaches),
    }


def get_run(store: Store, name: str) -> dict[str, Any]:
    summary = store.run_summary(name)
    if summary is None:
        raise UnknownRun(f"no run is named {brief(name)}; GET /v1/runs lists the runs")
    return run_json(summary)


def list_runs(store: Store, limit: int = 100, cursor: str | None = None) -> dict[str, Any]:
    """A page of runs in name order; ``cursor`` is an earlier page's ``next_cursor``."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidPayload(f"limit must be from 1 to {MAX_PAGE}", "limit")
    if cursor is not None and not is_run_name(cursor):
        raise InvalidPayload("cursor must be a next_cursor from an earlier page", "cursor")
    summaries = store.list_runs(cursor, limit + 1)
    more = len(summaries) > limit
    page = summaries[:limit]
    return {
        "runs": [run_json(s) for s in page],
        "next_cursor": page[-1].run.name if more else None,
    }


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
        "ranks_missing_count": result.ranks_missing_count,
        "ranks_late": result.ranks_late,
        "fragments": {"received": result.received, "expected": result.expected},
        "missing_fragments": {str(r): n for r, n in result.missing_fragments.items()},
        "metrics": shown,
        "breaches": result.breaches,
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
            raise MetricNotFound(f"run {run.name!r} has no metric {brief(name)}", where)


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
        if not _STEP_CURSOR.fullmatch(cursor):
            raise InvalidPayload("cursor must be a next_cursor from an earlier page", "cursor")
        if int(cursor) >= MAX_INT:  # after the last step there can be: nothing more
            return {"steps": [], "next_cursor": None}
        start = max(start or 0, int(cursor) + 1)
    records = store.list_steps(run, start, end, limit)
    page = [step_json(run, r, metrics) for r in records]
    more = len(records) == limit
    return {"steps": page, "next_cursor": str(records[-1].step) if more else None}


def series(
    store: Store,
    run: RunRecord,
    metric: str,
    start: int | None,
    end: int | None,
    points: int | None = None,
) -> dict[str, Any]:
    """A metric's finalised values; downsampled past ``points`` steps (or past
    ``MAX_SERIES`` when ``points`` is not given)."""
    _check_metrics(run, [metric], "path.metric")
    if start is not None and end is not None and end < start:
        raise InvalidPayload(f"end ({end}) is before start ({start})", "end")
    if points is not None and not MIN_POINTS <= points <= MAX_POINTS:
        raise InvalidPayload(f"points must be from {MIN_POINTS} to {MAX_POINTS}", "points")
    col = run.value_column_of.get(metric)
    if col is None:  # declared, but registered before its column existed: nothing stored
        col = _NO_COLUMN
    rows = store.series(run, col, start, end, points or MAX_SERIES)
    kind = run.spec.metrics.get(metric)
    return {
        "metric": metric,
        "kind": kind.value if kind is not None else "derived",
        "total": rows.total,
        "downsampled": rows.downsampled,
        "steps": rows.steps,
        "values": [_encoded(v, s) for v, s in zip(rows.values, rows.states, strict=True)],
        "status": [s.value for s in rows.status],
        "revision": rows.revision,
        "breaches": _series_breaches(store, run, metric, start, end),
    }


_BREACH_CURSOR = re.compile(r"([0-9]{1,19}):([A-Za-z_][A-Za-z0-9_]{0,127})")
BREACH_CURSOR_PATTERN = f"^{_BREACH_CURSOR.pattern}$"
#: a series shows at most this many breaches of its metric (the earliest of its range)
MAX_SERIES_BREACHES = 10_000


def breach_json(record: BreachRecord) -> dict[str, Any]:
    return {
        "step": record.step,
        "revision": record.revision,
        "finalised_at": timestamp(record.finalised_at),
        **record.breach,
    }


def list_breaches(
    store: Store,
    run: RunRecord,
    start: int | None,
    end: int | None,
    rules: Sequence[str],
    limit: int,
    cursor: str | None,
) -> dict[str, Any]:
    """A page of the run's breaches in (step, rule) order: each (step, rule) once, as the
    revision that first broke the rule showed it."""
    known = {r.name for r in run.spec.alerts}
    for name in rules:
        if name not in known:
            raise RuleNotFound(f"run {run.name!r} has no alert rule {brief(name)}", "rule")
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidPayload(f"limit must be from 1 to {MAX_PAGE}", "limit")
    after = None
    if cursor is not None:
        found = _BREACH_CURSOR.fullmatch(cursor)
        if found is None:
            raise InvalidPayload("cursor must be a next_cursor from an earlier page", "cursor")
        after = (min(int(found[1]), MAX_INT), found[2])
    records = store.breaches(run, start, end, list(rules) or None, after, limit)
    more = len(records) == limit
    last = records[-1] if more else None
    return {
        "breaches": [breach_json(r) for r in records],
        "next_cursor": None if last is None else f"{last.step}:{last.rule}",
    }


def _series_breaches(
    store: Store, run: RunRecord, metric: str, start: int | None, end: int | None
) -> list[dict[str, Any]]:
    rules = [r.name for r in run.spec.alerts if r.metric == metric]
    if not rules:
        return []
    found = store.breaches(run, start, end, rules, None, MAX_SERIES_BREACHES)
    return [{"step": b.step, "rule": b.rule} for b in found]


def _encoded(value: float | None, state: ValueState) -> float | str | None:
    if state is ValueState.NUMBER:
        assert value is not None
        return encode_number(value)
    return "NaN" if state is ValueState.NAN else None
