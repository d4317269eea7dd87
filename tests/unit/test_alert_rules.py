"""Alert rules: what a spec may declare, how a re-registration merges them, and what a
step's values breach (pure: the algebra's own check)."""

from __future__ import annotations

import math

import pytest

from steptally.client.algebra import MetricSpec, SpecConflict, SpecError
from steptally.client.algebra.alerts import AlertRule, Breach, check

METRICS = {"a": "sum", "n": "count"}
DERIVED = {"m": "a / n"}


def _spec(*rules: dict[str, object]) -> MetricSpec:
    return MetricSpec.build(METRICS, DERIVED, alerts=list(rules))


def _none(metric: str, n: int) -> list[float]:
    return []


def test_a_spec_keeps_its_rules_through_json() -> None:
    spec = _spec(
        {"name": "high", "metric": "m", "above": 0.5},
        {"name": "band", "metric": "m", "above": 1.1, "below": 0.9},
        {"name": "jump", "metric": "a", "change_above": 0.25, "window": 3, "relative": True},
        {"name": "ranks", "missing_ranks_above": 0},
        {"name": "nan", "metric": "m", "non_finite": True},
    )
    again = MetricSpec.from_json(spec.to_json())
    assert again.alerts == spec.alerts
    assert spec.alerts[2] == AlertRule("jump", "a", change_above=0.25, window=3, relative=True)
    assert spec.to_json()["alerts"][3] == {"name": "ranks", "missing_ranks_above": 0}
    assert "alerts" not in MetricSpec.build(METRICS).to_json()  # none: the JSON is as before


def test_a_change_rule_defaults_to_a_window_of_ten() -> None:
    assert _spec({"name": "j", "metric": "m", "change_above": 1}).alerts[0].window == 10


@pytest.mark.parametrize(
    ("rule", "says"),
    [
        ({"name": "x", "metric": "nope", "above": 1}, "does not declare"),
        ({"name": "x", "metric": "m"}, "exactly one condition"),
        ({"name": "x", "metric": "m", "above": 1, "non_finite": True}, "exactly one condition"),
        ({"name": "x", "metric": "m", "above": "1"}, "finite number"),
        ({"name": "x", "metric": "m", "above": math.inf}, "finite number"),
        ({"name": "x", "metric": "m", "above": True}, "finite number"),
        ({"name": "x", "metric": "m", "above": 0.9, "below": 1.1}, "lower bound"),
        ({"name": "x", "metric": "m", "change_above": -1}, "0 or more"),
        ({"name": "x", "metric": "m", "change_above": 1, "window": 0}, "from 1 to 1000"),
        ({"name": "x", "metric": "m", "change_above": 1, "window": 2.5}, "from 1 to 1000"),
        ({"name": "x", "metric": "m", "above": 1, "window": 3}, "go with change_above"),
        ({"name": "x", "metric": "m", "missing_ranks_above": 1}, "takes no metric"),
        ({"name": "x", "missing_ranks_above": -1}, "0 or more"),
        ({"name": "x", "metric": "m", "non_finite": 1}, "true or false"),
        ({"name": "x", "metric": "m", "above": 1, "when": "now"}, "unknown fields 'when'"),
        ({"name": "1x", "metric": "m", "above": 1}, "name '1x' is invalid"),
        ("kl > 1", "is an object"),
    ],
)
def test_a_bad_rule_is_refused_saying_why(rule: object, says: str) -> None:
    with pytest.raises(SpecError, match=says):
        MetricSpec.build(METRICS, DERIVED, alerts=[rule])


def test_rule_names_are_unique_and_alerts_is_a_list() -> None:
    with pytest.raises(SpecError, match="declared twice"):
        _spec({"name": "x", "metric": "m", "above": 1}, {"name": "x", "metric": "a", "above": 2})
    with pytest.raises(SpecError, match="a list of rules"):
        MetricSpec.build(METRICS, alerts={"name": "x"})


def test_a_registration_adds_rules_and_a_changed_rule_conflicts() -> None:
    old = _spec({"name": "high", "metric": "m", "above": 0.5})
    new = _spec(
        {"name": "high", "metric": "m", "above": 0.5}, {"name": "low", "metric": "m", "below": 0}
    )
    assert [r.name for r in old.merged_with(new).alerts] == ["high", "low"]
    assert old.merged_with(_spec()).alerts == old.alerts  # a spec without rules keeps them
    with pytest.raises(SpecConflict, match="alert rule 'high' is registered as"):
        old.merged_with(_spec({"name": "high", "metric": "m", "above": 0.6}))


def test_thresholds_breach_strictly_and_nan_or_undefined_breach_nothing() -> None:
    rules = _spec(
        {"name": "high", "metric": "m", "above": 0.5},
        {"name": "band", "metric": "a", "above": 1.1, "below": 0.9},
    ).alerts
    assert check(rules, {"m": 0.5, "a": 1.1}, 0, _none) == []  # at the bound: no breach
    assert check(rules, {"m": 0.75, "a": 0.5}, 0, _none) == [
        Breach("high", "above", "m", 0.75, 0.5),
        Breach("band", "below", "a", 0.5, 0.9),
    ]
    assert check(rules, {"m": math.nan, "a": None}, 0, _none) == []
    assert check(rules, {"m": math.inf, "a": -math.inf}, 0, _none) == [
        Breach("high", "above", "m", math.inf, 0.5),
        Breach("band", "below", "a", -math.inf, 0.9),
    ]


def test_missing_ranks_and_non_finite_rules() -> None:
    rules = _spec(
        {"name": "ranks", "missing_ranks_above": 1},
        {"name": "nan", "metric": "m", "non_finite": True},
    ).alerts
    assert check(rules, {"m": 1.0}, 1, _none) == []
    found = check(rules, {"m": math.nan}, 2, _none)
    assert found[0] == Breach("ranks", "missing_ranks_above", None, 2.0, 1)
    assert found[1].rule == "nan" and math.isnan(found[1].value)
    assert check(rules, {"m": None}, 0, _none) == []  # undefined is not non-finite


def test_a_change_rule_compares_with_the_mean_of_a_full_window_of_finite_values() -> None:
    absolute = _spec({"name": "j", "metric": "m", "change_above": 0.5, "window": 3}).alerts
    relative = _spec(
        {"name": "j", "metric": "m", "change_above": 0.5, "window": 3, "relative": True}
    ).alerts
    asked: list[tuple[str, int]] = []

    def history(values: list[float]):  # type: ignore[no-untyped-def]
        def read(metric: str, n: int) -> list[float]:
            asked.append((metric, n))
            return values[:n]

        return read

    # the mean of 1, 2, 3 is 2: 2.5 is within 0.5 of it, 2.75 is not
    assert check(absolute, {"m": 2.5}, 0, history([1.0, 2.0, 3.0])) == []
    assert check(absolute, {"m": 2.75}, 0, history([1.0, 2.0, 3.0])) == [
        Breach("j", "change_above", "m", 2.75, 0.5, 2.0)
    ]
    assert asked == [("m", 3), ("m", 3)]
    assert check(absolute, {"m": 9.0}, 0, history([1.0, 2.0])) == []  # not a full window
    assert check(absolute, {"m": 9.0}, 0, history([1.0, math.nan, 3.0])) == []
    assert check(absolute, {"m": math.inf}, 0, history([1.0, 2.0, 3.0])) == []
    # relative: |value - mean| > 0.5 * |mean| = 1
    assert check(relative, {"m": 3.0}, 0, history([1.0, 2.0, 3.0])) == []
    assert check(relative, {"m": 0.5}, 0, history([1.0, 2.0, 3.0])) == [
        Breach("j", "change_above", "m", 0.5, 0.5, 2.0)
    ]
