"""Combine a step's fragments exactly and describe the result (pure).

The same function finalises a step (its answer is stored) and shows an open step's
metrics so far (its answer is thrown away), whatever store the fragments came from.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any, cast

from steptally.client.algebra import MetricResult, StepAccumulator, alerts
from steptally.client.wire import encode_number
from steptally.service.domain import packing, partial
from steptally.service.domain.progress import Progress, StepStatus
from steptally.service.domain.run import RunRecord

MetricJson = dict[str, Any]


@dataclass(frozen=True, slots=True)
class StepResult:
    """What a finalised step reports; stored as JSON beside the step."""

    status: StepStatus
    metrics: Mapping[str, MetricJson]
    ranks_committed: list[int]
    ranks_missing: list[int]
    missing_fragments: dict[int, int]
    received: int
    expected: int | None
    ranks_late: list[int] = field(default_factory=list)  # committed after a partial finalisation
    missing_count: int | None = None  # all missing ranks (ranks_missing lists the first ones)
    breaches: list[dict[str, Any]] = field(default_factory=list)  # alert rules broken

    @property
    def ranks_missing_count(self) -> int:
        return len(self.ranks_missing) if self.missing_count is None else self.missing_count

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status.value,
            "metrics": dict(self.metrics),
            "ranks_committed": self.ranks_committed,
            "ranks_missing": self.ranks_missing,
            "missing_fragments": {str(r): n for r, n in self.missing_fragments.items()},
            "received": self.received,
            "expected": self.expected,
            "ranks_late": self.ranks_late,
            "ranks_missing_count": self.ranks_missing_count,
            "breaches": self.breaches,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepResult:
        return cls(
            StepStatus(data["status"]),
            data["metrics"],
            list(data["ranks_committed"]),
            list(data["ranks_missing"]),
            {int(r): int(n) for r, n in data["missing_fragments"].items()},
            int(data["received"]),
            data["expected"],
            list(data.get("ranks_late", ())),
            data.get("ranks_missing_count"),
            list(data.get("breaches", ())),
        )


def metric_json(result: MetricResult) -> MetricJson:
    """One metric for JSON, its value a number or a proto3 string for NaN and infinities."""
    out = result.to_json()
    value = result.value
    if value is not None and not math.isfinite(value):
        out["value"] = encode_number(value)
    return out


def combine(run: RunRecord, fragments: Sequence[packing.Cell]) -> dict[str, MetricResult]:
    """Every metric and derived value of the run over ``fragments``, each rounded once."""
    return partial.of_cells(run, fragments).report()


#: what a step is evaluated from: its fragments, or their exact partial state merged
Contributions = Sequence[packing.Cell] | StepAccumulator | partial.Merged


def evaluate(
    run: RunRecord, progress: Progress, fragments: Contributions, status: StepStatus
) -> StepResult:
    """The result of a step with ``status``, from all of its stored fragments or their
    merged partial state (the same bits either way)."""
    if isinstance(fragments, StepAccumulator | partial.Merged):
        report = fragments.report()
    else:
        report = partial.of_cells(run, fragments).report()
    return StepResult(
        status=status,
        metrics={name: metric_json(r) for name, r in report.items()},
        ranks_committed=progress.ranks_committed(),
        ranks_missing=progress.ranks_missing(),
        missing_count=progress.ranks_missing_count(),
        missing_fragments=progress.missing_fragments(),
        received=progress.received_total(),
        expected=progress.expected(),
    )


class ValueState(IntEnum):
    """How a stored per-step value reads: ``step_values.state``."""

    NUMBER = 0  # finite or infinite, in ``value``
    NAN = 1
    UNDEFINED = 2  # no value: a zero denominator, no contributions, …


StoredValue = tuple[int, float | None, int]  # (column, value, state)
NUMBER = int(ValueState.NUMBER)
# A metric's JSON value that is not a number: undefined, or a proto3 string.
_NOT_A_NUMBER: dict[object, tuple[float | None, ValueState]] = {
    None: (None, ValueState.UNDEFINED),
    "NaN": (None, ValueState.NAN),
    "Infinity": (math.inf, ValueState.NUMBER),
    "-Infinity": (-math.inf, ValueState.NUMBER),
}
# What each state shows as a float (NUMBER: the number itself).
_SHOWN: dict[ValueState, float | None] = {ValueState.NAN: math.nan, ValueState.UNDEFINED: None}


def read_value(value: float | str | None) -> tuple[float | None, ValueState]:
    """A metric's JSON value (:func:`metric_json`) as a stored value and its state."""
    known = _NOT_A_NUMBER.get(value)
    return known if known is not None else (float(cast(float, value)), ValueState.NUMBER)


def shown_value(value: float | str | None) -> float | None:
    """A metric's JSON value as a float: NaN and the infinities as such, None if undefined."""
    number, state = read_value(value)
    return _SHOWN.get(state, number)


def stored_values(run: RunRecord, result: StepResult) -> list[StoredValue]:
    """One (column, value, state) per metric and derived value of ``result``."""
    out: list[StoredValue] = []
    metrics = result.metrics
    for name, col in run.value_column_of.items():
        metric = metrics.get(name)
        if metric is None:
            continue
        value = metric["value"]
        if value.__class__ is float:  # a finite number, as most are
            out.append((col, value, NUMBER))
            continue
        number, state = read_value(value)
        out.append((col, number, int(state)))
    return out


def with_late_ranks(result: StepResult, previous: StepResult | None) -> StepResult:
    """``result`` of a re-finalisation after ``previous`` (a partial one, or None), with
    the ranks that committed since the step was first finalised partial."""
    if previous is None:
        return result
    late = set(previous.ranks_late) | (set(result.ranks_committed) - set(previous.ranks_committed))
    return replace(result, ranks_late=sorted(late))


def breaches_of(run: RunRecord, result: StepResult, history: alerts.History) -> list[alerts.Breach]:
    """The alert rules of ``run`` that ``result`` breaks (``history``: earlier values)."""
    rules = run.spec.alerts
    if not rules:
        return []
    values = {
        r.metric: shown_value(result.metrics[r.metric]["value"])
        for r in rules
        if r.metric is not None and r.metric in result.metrics
    }
    return alerts.check(rules, values, result.ranks_missing_count, history)


def no_history(metric: str, n: int) -> list[float]:
    return []


def final_status(progress: Progress) -> StepStatus:
    """The status a step takes when it is finalised now."""
    return StepStatus.COMPLETE if progress.is_complete() else StepStatus.PARTIAL
