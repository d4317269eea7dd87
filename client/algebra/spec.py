"""The metric spec of a run: each metric's kind and the derived expressions."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from steptally.client.algebra import alerts as alert_rules
from steptally.client.algebra import expression
from steptally.client.algebra.errors import ExpressionError, SpecConflict, SpecError
from steptally.client.algebra.kind import Kind, check_name, parse_kind

MAX_METRICS = 4096


@dataclass(frozen=True)
class SpecLimits:
    """How costly a spec's derived expressions may be as a whole (see
    :class:`~steptally.client.algebra.expression.Cost`): a registration past one is
    refused; a spec read back from storage is not checked again (its evaluation is
    bounded anyway)."""

    max_size: int = 10_000
    max_depth: int = 200
    max_chain: int = 16

    def check(self, parsed: Mapping[str, expression.Node]) -> None:
        found = expression.cost(parsed, cap=self.max_size + 1)
        for what, value, limit, hint in (
            ("operands (derived names expanded)", found.size, self.max_size, "fewer"),
            (
                "levels of nesting (derived names expanded)",
                found.depth,
                self.max_depth,
                "a flatter expression",
            ),
            ("derived values in one chain", found.chain, self.max_chain, "a shorter chain"),
        ):
            if value > limit:
                raise ExpressionError(
                    f"the derived expressions have more than {limit} {what}; use {hint}"
                )


@dataclass(frozen=True)
class MetricSpec:
    """Kinds of the base metrics, derived expressions over them, and guards.

    A **guard** ties a ``min``/``max`` metric to a ``count`` or ``sum`` metric of the
    same fragment: the extreme's value counts only in fragments whose guard value is
    greater than zero. That is how a worker reports "the extreme over a mask" without
    a device sync: it always sends the extreme (a neutral ±inf over an empty mask) and
    the mask's size beside it, and an empty mask contributes nothing.

    ``alerts`` are the run's alert rules (:mod:`steptally.client.algebra.alerts`), each
    on a metric or derived value of the spec.

    ``MetricSpec.build`` validates; the constructor trusts its arguments.
    """

    metrics: Mapping[str, Kind]
    derived: Mapping[str, str] = field(default_factory=dict)
    guards: Mapping[str, str] = field(default_factory=dict)
    parsed: Mapping[str, expression.Node] = field(default_factory=dict, compare=False, repr=False)
    alerts: tuple[alert_rules.AlertRule, ...] = ()

    @classmethod
    def build(
        cls,
        metrics: Mapping[str, Any],
        derived: Mapping[str, str] | None = None,
        guards: Mapping[str, str] | None = None,
        limits: SpecLimits | None = None,
        alerts: Any = None,
    ) -> MetricSpec:
        """Validate; with ``limits``, also the cost of the derived expressions as a whole.
        ``alerts`` is the JSON list of alert rules (or rules already parsed)."""
        derived = dict(derived or {})
        kinds = {check_name(name): parse_kind(kind, name) for name, kind in metrics.items()}
        if len(kinds) + len(derived) > MAX_METRICS:
            raise SpecError(f"a run may have at most {MAX_METRICS} metrics and derived values")
        parsed: dict[str, expression.Node] = {}
        for name, text in derived.items():
            check_name(name)
            if name in kinds:
                raise SpecError(f"{name!r} is both a metric and a derived expression")
            try:
                parsed[name] = expression.parse(text)
            except ExpressionError as exc:
                raise ExpressionError(f"derived {name!r}: {exc}") from None
        for name, node in parsed.items():
            unknown = sorted(expression.names(node) - kinds.keys() - parsed.keys())
            if unknown:
                raise ExpressionError(
                    f"derived {name!r} refers to {', '.join(map(repr, unknown))}, which the spec "
                    "does not declare; declare it as a metric or fix the expression"
                )
        _check_acyclic(parsed)
        if limits is not None:
            limits.check(parsed)
        guards = dict(guards or {})
        _check_guards(kinds, guards)
        if isinstance(alerts, tuple | list):
            alerts = [r.to_json() if isinstance(r, alert_rules.AlertRule) else r for r in alerts]
        rules = alert_rules.parse_all(alerts, [*kinds, *parsed])
        return cls(kinds, {n: t.strip() for n, t in derived.items()}, guards, parsed, rules)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MetricSpec:
        return cls.build(
            data.get("metrics", {}),
            data.get("derived", {}),
            data.get("guards", {}),
            alerts=data.get("alerts"),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "metrics": {n: k.value for n, k in self.metrics.items()},
            "derived": dict(self.derived),
            "guards": dict(self.guards),
        }
        if self.alerts:
            out["alerts"] = [rule.to_json() for rule in self.alerts]
        return out

    @cached_property
    def kinds(self) -> tuple[tuple[str, str], ...]:
        """Each base metric's name and kind's name, in order (what a report names)."""
        return tuple((name, kind.value) for name, kind in self.metrics.items())

    def names(self) -> list[str]:
        return [*self.metrics, *self.derived]

    def merged_with(self, new: MetricSpec, limits: SpecLimits | None = None) -> MetricSpec:
        """The spec after registering ``new`` over ``self``: new names are added;
        a changed kind or a changed meaning of a derived expression is a conflict."""
        conflicts: list[str] = []
        for name, kind in new.metrics.items():
            if name in self.derived:
                conflicts.append(f"{name!r} is registered as a derived expression, not a {kind}")
            elif name in self.metrics and self.metrics[name] is not kind:
                conflicts.append(
                    f"metric {name!r} is registered as {self.metrics[name]}, not {kind}"
                )
        for name, node in new.parsed.items():
            if name in self.metrics:
                conflicts.append(f"{name!r} is registered as a {self.metrics[name]} metric")
            elif name in self.parsed and expression.canonical(
                self.parsed[name]
            ) != expression.canonical(node):
                conflicts.append(
                    f"derived {name!r} is registered as {self.derived[name]!r}, "
                    f"not {new.derived[name]!r}"
                )
        for name in new.metrics.keys() & self.metrics.keys():
            old_guard, new_guard = self.guards.get(name), new.guards.get(name)
            if old_guard != new_guard:
                conflicts.append(
                    f"metric {name!r} is registered with guard {old_guard!r}, not {new_guard!r}"
                )
        rules = self.alerts
        try:
            rules = alert_rules.merged(self.alerts, new.alerts)
        except SpecConflict as exc:
            conflicts.extend(exc.conflicts)
        if conflicts:
            raise SpecConflict(conflicts)
        metrics = {**self.metrics, **new.metrics}
        derived = {
            **self.derived,
            **{n: t for n, t in new.derived.items() if n not in self.derived},
        }
        return MetricSpec.build(metrics, derived, {**self.guards, **new.guards}, limits, rules)


def _check_guards(kinds: Mapping[str, Kind], guards: Mapping[str, str]) -> None:
    for name, guard in guards.items():
        if kinds.get(name) not in (Kind.MIN, Kind.MAX):
            raise SpecError(f"guard of {name!r}: only a declared min or max metric takes a guard")
        if kinds.get(guard) not in (Kind.COUNT, Kind.SUM):
            raise SpecError(
                f"guard of {name!r} is {guard!r}, which must be a declared count or sum metric"
            )


def _check_acyclic(parsed: Mapping[str, expression.Node]) -> None:
    """Raise on a cycle of derived names (iterative: a chain of any length is fine)."""
    state: dict[str, int] = {}
    refs = {n: sorted(expression.names(node) & parsed.keys()) for n, node in parsed.items()}
    for start in parsed:
        if state.get(start) == 2:
            continue
        path = [start]
        todo = [iter(refs[start])]
        state[start] = 1
        while todo:
            ref = next(todo[-1], None)
            if ref is None:
                state[path.pop()] = 2
                todo.pop()
            elif state.get(ref) == 1:
                cycle = " -> ".join([*path[path.index(ref) :], ref])
                raise ExpressionError(
                    f"derived expressions refer to each other in a cycle: {cycle}"
                )
            elif state.get(ref) is None:
                state[ref] = 1
                path.append(ref)
                todo.append(iter(refs[ref]))
