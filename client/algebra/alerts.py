"""Alert rules of a run, and the check of one finalised step against them (stdlib only).

A run's spec may declare rules; the service checks every finalised step against them
once per revision, inside the transaction that finalises it, and keeps what breaches.
A rule is one of:

* a **threshold** on a metric or derived value: ``{"name": "kl_spike", "metric": "kl",
  "above": 0.5}``, ``"below"``, or both (a band: outside it is a breach);
* a **change** against the mean of the previous ``window`` steps' values:
  ``{"name": "kl_jump", "metric": "kl", "change_above": 0.1, "window": 10}`` breaches
  when ``|value - mean| > 0.1``; with ``"relative": true``, when ``|value - mean| >
  0.1 * |mean|``. The window is the ``window`` nearest earlier steps finalised before
  this one; it is checked only when all of them hold a finite number;
* **missing ranks**: ``{"name": "ranks", "missing_ranks_above": 0}`` (no metric);
* **non-finite**: ``{"name": "loss_nan", "metric": "loss", "non_finite": true}`` breaches
  on NaN or an infinity.

An undefined value (a zero denominator, nothing to combine) breaches nothing; NaN
breaches only a non-finite rule (it is neither above nor below anything).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from steptally.client.algebra.errors import AlertRuleError, SpecConflict
from steptally.client.algebra.kind import NAME_PATTERN

MAX_RULES = 256
MAX_WINDOW = 1000
DEFAULT_WINDOW = 10
_FIELDS = frozenset(
    {
        "name",
        "metric",
        "above",
        "below",
        "change_above",
        "window",
        "relative",
        "missing_ranks_above",
        "non_finite",
    }
)


@dataclass(frozen=True, slots=True)
class AlertRule:
    """One rule; :func:`parse` validates, the constructor trusts its arguments."""

    name: str
    metric: str | None = None
    above: float | None = None
    below: float | None = None
    change_above: float | None = None
    window: int | None = None
    relative: bool = False
    missing_ranks_above: int | None = None
    non_finite: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.metric is not None:
            out["metric"] = self.metric
        for key in ("above", "below", "change_above", "window", "missing_ranks_above"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.relative:
            out["relative"] = True
        if self.non_finite:
            out["non_finite"] = True
        return out


def parse(data: object, metrics: Iterable[str]) -> AlertRule:
    """A rule from its JSON, its metric one of ``metrics``; :class:`AlertRuleError` says
    what is wrong with it."""
    if not isinstance(data, Mapping):
        raise AlertRuleError(f"an alert rule is an object, not {type(data).__name__}")
    name = data.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise AlertRuleError(
            f"alert rule name {name!r:.40} is invalid: use letters, digits and '_', "
            "starting with a letter or '_', at most 128 characters"
        )
    where = f"alert rule {name!r}"
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise AlertRuleError(
            f"{where} has unknown fields {', '.join(map(repr, unknown))}; a rule takes "
            f"{', '.join(sorted(_FIELDS))}"
        )
    metric = data.get("metric")
    ranks = data.get("missing_ranks_above")
    families = [
        key
        for key, present in (
            ("above/below", "above" in data or "below" in data),
            ("change_above", "change_above" in data),
            ("missing_ranks_above", ranks is not None),
            ("non_finite", bool(data.get("non_finite"))),
        )
        if present
    ]
    if len(families) != 1:
        raise AlertRuleError(
            f"{where} needs exactly one condition: above and/or below, change_above, "
            f"missing_ranks_above or non_finite (it has {', '.join(families) or 'none'})"
        )
    if "non_finite" in data and not isinstance(data["non_finite"], bool):
        raise AlertRuleError(f"{where}: non_finite is true or false")
    if ranks is not None:
        if metric is not None:
            raise AlertRuleError(f"{where}: missing_ranks_above counts ranks and takes no metric")
        if not _is_int(ranks) or ranks < 0:
            raise AlertRuleError(
                f"{where}: missing_ranks_above is a whole number of ranks, 0 or more"
            )
        return AlertRule(name, missing_ranks_above=int(ranks))
    known = set(metrics)
    if not isinstance(metric, str) or metric not in known:
        raise AlertRuleError(
            f"{where} checks metric {metric!r:.40}, which the spec does not declare; "
            "name one of its metrics or derived values"
        )
    above, below = _threshold(data, "above", where), _threshold(data, "below", where)
    if above is not None and below is not None and below > above:
        raise AlertRuleError(
            f"{where}: below ({below:g}) is above above ({above:g}); a band breaches outside "
            "[below, above], so below is the lower bound"
        )
    change = _threshold(data, "change_above", where)
    if change is not None and change < 0:
        raise AlertRuleError(f"{where}: change_above is a distance, 0 or more")
    window = data.get("window")
    relative = data.get("relative", False)
    if change is None and (window is not None or relative):
        raise AlertRuleError(f"{where}: window and relative go with change_above")
    if change is not None:
        window = DEFAULT_WINDOW if window is None else window
        if not _is_int(window) or not 1 <= window <= MAX_WINDOW:
            raise AlertRuleError(f"{where}: window is a number of steps from 1 to {MAX_WINDOW}")
        if not isinstance(relative, bool):
            raise AlertRuleError(f"{where}: relative is true or false")
        window = int(window)
    return AlertRule(
        name,
        str(metric),  # a plain string, whatever str subclass (a StrEnum name) named it
        above,
        below,
        change,
        window,
        relative,
        non_finite=bool(data.get("non_finite")),
    )


def parse_all(rules: object, metrics: Iterable[str]) -> tuple[AlertRule, ...]:
    """Every rule of a spec's ``alerts`` list, names unique."""
    if rules is None:
        return ()
    if not isinstance(rules, Sequence) or isinstance(rules, str | bytes):
        raise AlertRuleError("alerts is a list of rules")
    if len(rules) > MAX_RULES:
        raise AlertRuleError(f"a run may have at most {MAX_RULES} alert rules")
    names = list(metrics)
    out = tuple(parse(r, names) for r in rules)
    seen: set[str] = set()
    for rule in out:
        if rule.name in seen:
            raise AlertRuleError(f"alert rule {rule.name!r} is declared twice")
        seen.add(rule.name)
    return out


def merged(old: Sequence[AlertRule], new: Sequence[AlertRule]) -> tuple[AlertRule, ...]:
    """``old`` with the rules of ``new`` it lacks; a rule whose definition changed is a
    :class:`SpecConflict` (a rule's meaning never changes: add one under a new name)."""
    have = {r.name: r for r in old}
    conflicts = [
        f"alert rule {r.name!r} is registered as {have[r.name].to_json()}, not {r.to_json()}"
        for r in new
        if r.name in have and have[r.name] != r
    ]
    if conflicts:
        raise SpecConflict(conflicts)
    return (*old, *(r for r in new if r.name not in have))


def _is_int(value: object) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _threshold(data: Mapping[str, Any], key: str, where: str) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise AlertRuleError(f"{where}: {key} is a finite number, not {value!r:.40}")
    return float(value)


@dataclass(frozen=True, slots=True)
class Breach:
    """A rule a step's value broke: ``value`` is what was checked (the missing-rank count
    for a rank rule); ``mean`` the window's mean for a change rule."""

    rule: str
    condition: str
    metric: str | None
    value: float
    threshold: float | None = None
    mean: float | None = None

    def to_json(self, number: Callable[[float], float | str]) -> dict[str, Any]:
        """As JSON, each float through ``number`` (NaN and infinities as strings)."""
        out: dict[str, Any] = {
            "rule": self.rule,
            "condition": self.condition,
            "metric": self.metric,
            "value": number(self.value),
        }
        if self.threshold is not None:
            out["threshold"] = number(self.threshold)
        if self.mean is not None:
            out["mean"] = number(self.mean)
        return out


#: the previous finite values of a metric: (metric, how many) -> up to that many values
History = Callable[[str, int], Sequence[float]]


def check(
    rules: Sequence[AlertRule],
    values: Mapping[str, float | None],
    missing_ranks: int,
    history: History,
) -> list[Breach]:
    """The breaches of one finalised step: ``values`` its metrics as floats (None when
    undefined), ``missing_ranks`` how many ranks did not commit, ``history`` the
    previous steps' values for change rules."""
    out = []
    for rule in rules:
        found = _check(rule, values, missing_ranks, history)
        if found is not None:
            out.append(found)
    return out


def _check(
    rule: AlertRule, values: Mapping[str, float | None], missing_ranks: int, history: History
) -> Breach | None:
    if rule.missing_ranks_above is not None:
        if missing_ranks > rule.missing_ranks_above:
            return Breach(
                rule.name,
                "missing_ranks_above",
                None,
                float(missing_ranks),
                rule.missing_ranks_above,
            )
        return None
    assert rule.metric is not None
    value = values.get(rule.metric)
    if value is None:
        return None
    if rule.non_finite:
        return None if math.isfinite(value) else Breach(rule.name, "non_finite", rule.metric, value)
    if rule.change_above is not None:
        assert rule.window is not None
        window = [v for v in history(rule.metric, rule.window) if math.isfinite(v)]
        if len(window) < rule.window or not math.isfinite(value):
            return None
        mean = math.fsum(window) / len(window)
        limit = rule.change_above * abs(mean) if rule.relative else rule.change_above
        if abs(value - mean) > limit:
            return Breach(rule.name, "change_above", rule.metric, value, rule.change_above, mean)
        return None
    if rule.above is not None and value > rule.above:
        return Breach(rule.name, "above", rule.metric, value, rule.above)
    if rule.below is not None and value < rule.below:
        return Breach(rule.name, "below", rule.metric, value, rule.below)
    return None
