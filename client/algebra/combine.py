"""Combine fragments of one step exactly and report every metric, rounded once."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any, NamedTuple

from steptally.client.algebra import expression
from steptally.client.algebra.errors import ValueRejected
from steptally.client.algebra.exact import CountState, ExtremeState, SumState
from steptally.client.algebra.kind import Kind, check_expansion, check_value
from steptally.client.algebra.spec import MetricSpec

State = SumState | CountState | ExtremeState
#: a fragment's value: a float, or (sum metrics only) the terms of an exact expansion
Value = float | Sequence[float]


def new_state(kind: Kind) -> State:
    if kind is Kind.SUM:
        return SumState()
    if kind is Kind.COUNT:
        return CountState()
    return ExtremeState(is_max=kind is Kind.MAX)


class MetricResult(NamedTuple):
    """One reported value: ``value`` is None exactly when ``reason`` says why. (A named
    tuple: a step reports one a metric, and a frozen dataclass took ~4x as long to
    make.)"""

    value: float | None
    reason: str | None = None
    kind: str = "derived"
    n: int = 0
    non_finite: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "value": self.value,
            "reason": self.reason,
            "kind": self.kind,
            "values": self.n,
            "non_finite": self.non_finite,
        }


class StepAccumulator:
    """The exact partial state of one step: one state per metric that has values."""

    __slots__ = ("spec", "states")

    def __init__(self, spec: MetricSpec) -> None:
        self.spec = spec
        self.states: dict[str, State] = {}

    def _state(self, name: str) -> State:
        state = self.states.get(name)
        if state is None:
            kind = self.spec.metrics.get(name)
            if kind is None:
                raise ValueRejected(f"metric {name!r} is not in the run's spec")
            state = self.states[name] = new_state(kind)
        return state

    def add(self, values: Mapping[str, Value]) -> None:
        """Fold one fragment's values in (a guarded extreme only if its guard is > 0); a
        sum metric's value may be an expansion, whose terms all count."""
        guards = self.spec.guards
        for name, value in values.items():
            state = self._state(name)
            if not isinstance(value, float | int):
                self._add_expansion(name, state, value)
                continue
            check_value(self.spec.metrics[name], value, name)
            guard = values.get(guards[name], 0.0) if name in guards else 1.0
            if isinstance(guard, float | int) and guard > 0:
                state.add(value)

    def _add_expansion(self, name: str, state: State, terms: Sequence[float]) -> None:
        if not isinstance(state, SumState):
            raise ValueRejected(f"metric {name!r} is not a sum, so its value must be one number")
        check_expansion(terms, name)
        state.add_many(terms, fragments=1)

    def add_column(self, name: str, values: Sequence[float], tails: Sequence[float] = ()) -> None:
        """Fold many values of one metric in at once (already validated; for a guarded
        extreme, only the values whose fragments passed the guard); ``tails`` are the
        further terms of a sum's expansions, which add to the value but not to the count."""
        if values:
            self._state(name).add_many(values)
        if tails:
            state = self._state(name)
            assert isinstance(state, SumState)
            state.add_many(tails, fragments=0)

    def merge(self, other: StepAccumulator) -> None:
        """Fold another partial state in; order and grouping never change the result."""
        for name, state in other.states.items():
            self._state(name).merge(state)  # type: ignore[arg-type]

    def _exact(self, name: str) -> expression.Exact:
        state = self.states.get(name)
        if isinstance(state, ExtremeState) or (state is None and self._is_extreme(name)):
            value = state.exact() if state is not None else None
            if value is None:
                raise expression.Undefined(no_value(name))
            return value
        return state.exact() if state is not None else Fraction(0)

    def _rounded(self, name: str) -> float:
        """``to_float(self._exact(name))``; a sum or a count rounded from its integer
        directly (the same correctly rounded quotient), without the :class:`Fraction`
        whose reduction of a 2,100-bit integer costs ~5 µs a metric."""
        state = self.states.get(name)
        if isinstance(state, SumState | CountState):
            return state.value()
        return expression.to_float(self._exact(name))

    def _is_extreme(self, name: str) -> bool:
        return self.spec.metrics.get(name) in (Kind.MIN, Kind.MAX)

    def summary(self, name: str) -> Summary:
        """One metric as :func:`reported` takes it."""
        state = self.states.get(name)
        n = state.n if state is not None else 0
        bad = getattr(state, "non_finite", 0) if state is not None else 0
        try:
            return self._rounded(name), None, n, bad
        except expression.Undefined as exc:
            return None, exc.args[0], n, bad

    def report(self) -> dict[str, MetricResult]:
        """Every metric and derived value of the spec, each rounded once."""
        return reported(self.spec, self.summary, self._exact)


#: one metric's report: its value rounded once (None: undefined), why it is undefined,
#: the values folded in and how many of them were not finite
Summary = tuple[float | None, str | None, int, int]


def no_value(name: str) -> str:
    """Why a ``min`` or ``max`` that no value reached is undefined."""
    return f"no fragment carried a value of `{name}`"


def reported(
    spec: MetricSpec, summary: Callable[[str], Summary], exact: Callable[[str], expression.Exact]
) -> dict[str, MetricResult]:
    """Every metric of ``spec`` as ``summary`` reports it, then every derived value,
    evaluated over the metrics' ``exact`` values and rounded once: what a step reports,
    whatever holds its exact state (:class:`StepAccumulator`, or the compiled merge of
    stored states: ``steptally.service.domain.partial.Merged``)."""
    out: dict[str, MetricResult] = {}
    for name, kind in spec.kinds:
        value, reason, n, bad = summary(name)
        out[name] = MetricResult(value, reason, kind, n, bad)
    for name, result in expression.evaluate_all(spec.parsed, exact).items():
        if isinstance(result, expression.Undefined):
            out[name] = MetricResult(None, result.args[0])
        else:
            value = expression.to_float(result)
            out[name] = MetricResult(value, None, non_finite=int(not math.isfinite(value)))
    return out


def combine(spec: MetricSpec, fragments: Iterable[Mapping[str, Value]]) -> dict[str, MetricResult]:
    """Single-pass convenience: combine every fragment and report."""
    acc = StepAccumulator(spec)
    for values in fragments:
        acc.add(values)
    return acc.report()
