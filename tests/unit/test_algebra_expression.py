"""Derived expressions: parsed safely, evaluated exactly, undefined with a reason."""

from __future__ import annotations

import gc
import math
from fractions import Fraction

import pytest

from steptally.client.algebra import ExpressionError, MetricSpec, SpecConflict, SpecError, combine
from steptally.client.algebra import expression as ex


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a + b * c", Fraction(7)),
        ("(a + b) * c", Fraction(9)),
        ("a - b - c", Fraction(-4)),
        ("a / b / c", Fraction(1, 6)),
        ("-a + +b", Fraction(1)),
        ("0.1 * c", Fraction(3, 10)),
        ("1e1 / 4", Fraction(5, 2)),
        ("--a", Fraction(1)),
    ],
)
def test_precedence_and_exact_literals(text: str, expected: Fraction) -> None:
    values = {"a": Fraction(1), "b": Fraction(2), "c": Fraction(3)}
    assert ex.evaluate(ex.parse(text), values.__getitem__) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "a +",
        "(a",
        "a)",
        "a $ b",
        "__import__('os')",
        "a ** b",
        "1 2",
        "a.b",
        "[a]",
        "1e999999999",  # exact literals: an exponent this size would never finish
        "2e-401",
        "1" * 65,
        "(" * 400 + "a" + ")" * 400,  # deeper than the parser goes
        "-" * 900 + "a",
    ],
)
def test_bad_expressions_are_rejected(text: str) -> None:
    with pytest.raises(ExpressionError):
        ex.parse(text)


def test_moderate_nesting_is_fine() -> None:
    values = {"a": Fraction(3)}
    assert ex.evaluate(ex.parse("(" * 50 + "a" + ")" * 50), values.__getitem__) == 3
    assert ex.evaluate(ex.parse("-" * 51 + "a"), values.__getitem__) == -3


def test_zero_denominator_is_undefined_with_a_reason() -> None:
    spec = MetricSpec.build({"num": "sum", "n": "count"}, {"mean": "num / n", "twice": "2 * mean"})
    out = combine(spec, [{"num": 3.0, "n": 0}])
    assert out["mean"].value is None
    assert out["mean"].reason == "the denominator `n` is zero"
    assert out["twice"].value is None
    assert "`mean` is undefined" in (out["twice"].reason or "")


def test_non_finite_operands_follow_ieee() -> None:
    spec = MetricSpec.build(
        {"a": "sum", "b": "sum", "n": "count"}, {"r": "a / n", "s": "b / a", "d": "a - a"}
    )
    out = combine(spec, [{"a": math.inf, "b": 1.0, "n": 2}])
    assert out["r"].value == math.inf
    assert out["s"].value == 0.0
    assert math.isnan(out["d"].value or 0.0)
    assert out["d"].non_finite == 1


def test_exact_values_past_the_float_range_beside_non_finite_ones() -> None:
    """An exact sum past float64's range, or one too small for it, meets an infinity:
    only its sign and that it is not zero count (it once overflowed converting to a
    float)."""
    big = 1.7976931348623157e308
    spec = MetricSpec.build(
        {"a": "sum", "b": "sum", "n": "count"},
        {"over": "b / a", "times": "a * b", "minus": "b - a"},
    )
    out = combine(spec, [{"a": -math.inf, "b": big, "n": 2}, {"a": 1.0, "b": big, "n": 2}])
    assert out["over"].value == 0.0
    assert out["times"].value == -math.inf and out["minus"].value == math.inf
    tiny = MetricSpec.build({"a": "sum", "b": "sum", "n": "count"}, {"t": "(b * b) * a"})
    small = combine(tiny, [{"a": math.inf, "b": 5e-324, "n": 1}])
    assert small["t"].value == math.inf  # 2**-2148 is not zero: times inf is inf


def test_empty_extreme_is_undefined_not_a_sentinel() -> None:
    spec = MetricSpec.build({"lo": "min", "hi": "max", "t": "sum"})
    out = combine(spec, [{"t": 1.0}])
    assert out["lo"].value is None and out["hi"].value is None
    assert out["lo"].reason == "no fragment carried a value of `lo`"
    assert out["t"].value == 1.0


def test_spec_validation() -> None:
    with pytest.raises(SpecError, match="kind 'mean'"):
        MetricSpec.build({"a": "mean"})
    with pytest.raises(SpecError, match="invalid"):
        MetricSpec.build({"bad name": "sum"})
    with pytest.raises(ExpressionError, match="'missing'"):
        MetricSpec.build({"a": "sum"}, {"q": "a / missing"})
    with pytest.raises(ExpressionError, match="cycle"):
        MetricSpec.build({"a": "sum"}, {"p": "q + a", "q": "p * 2"})
    with pytest.raises(SpecError, match="both a metric and a derived"):
        MetricSpec.build({"a": "sum"}, {"a": "1"})


def test_merging_specs_adds_metrics_and_refuses_changes() -> None:
    old = MetricSpec.build({"a": "sum", "n": "count"}, {"m": "a / n"})
    same_meaning = MetricSpec.build({"a": "sum", "n": "count"}, {"m": " a/n "})
    merged = old.merged_with(same_meaning)
    assert merged == old
    grown = old.merged_with(MetricSpec.build({"b": "max"}))
    assert set(grown.metrics) == {"a", "n", "b"}
    with pytest.raises(SpecConflict) as info:
        old.merged_with(MetricSpec.build({"a": "max", "n": "count"}, {"m": "n / a"}))
    assert info.value.conflicts == [
        "metric 'a' is registered as sum, not max",
        "derived 'm' is registered as 'a / n', not 'n / a'",
    ]


def test_count_rejects_non_integers() -> None:
    from steptally.client.algebra import ValueRejected

    spec = MetricSpec.build({"n": "count"})
    for bad in (1.5, -1.0, math.nan, math.inf):
        with pytest.raises(ValueRejected, match="non-negative integer"):
            combine(spec, [{"n": bad}])


def test_a_guarded_extreme_counts_only_where_its_guard_is_positive() -> None:
    spec = MetricSpec.build({"hi": "max", "lo": "min", "n": "count"}, guards={"hi": "n", "lo": "n"})
    out = combine(
        spec,
        [
            {"hi": -math.inf, "lo": math.inf, "n": 0},  # empty mask: the neutral sentinels
            {"hi": 2.0, "lo": 0.5, "n": 3},
            {"hi": math.inf, "lo": math.nan, "n": 1},  # real non-finite values stay data
        ],
    )
    assert out["hi"].value == math.inf
    assert math.isnan(out["lo"].value or 0.0)
    only_empty = combine(spec, [{"hi": -math.inf, "lo": math.inf, "n": 0}])
    assert only_empty["hi"].value is None and only_empty["lo"].value is None


def test_guards_are_validated_and_part_of_the_meaning() -> None:
    with pytest.raises(SpecError, match="only a declared min or max"):
        MetricSpec.build({"a": "sum", "n": "count"}, guards={"a": "n"})
    with pytest.raises(SpecError, match="count or sum"):
        MetricSpec.build({"a": "max", "b": "min"}, guards={"a": "b"})
    guarded = MetricSpec.build({"a": "max", "n": "count"}, guards={"a": "n"})
    assert MetricSpec.from_json(guarded.to_json()) == guarded
    with pytest.raises(SpecConflict, match="guard"):
        guarded.merged_with(MetricSpec.build({"a": "max", "n": "count"}))


def test_an_evaluation_leaves_no_reference_cycle_for_the_collector() -> None:
    """Every value and undefined cause is freed when the evaluation is dropped: nothing
    of it waits for the cyclic collector, whose passes stop a serving process."""
    spec = MetricSpec.build(
        {"a": "sum", "n": "count", "lo": "min"},
        {
            "mean": "a / n",
            "twice": "mean * 2",
            "by_zero": "a / (n - n)",
            "after_zero": "by_zero + 1",
            "no_min": "lo * 2",
            "deep": " * ".join(["a"] * 30),  # past the bits bound: undefined
        },
    )
    fragments = [{"a": [1e300, 1e-300], "n": 1}] * 3
    gc.collect()
    gc.disable()
    try:
        report = combine(spec, fragments)
        freed_by_the_collector = gc.collect()
    finally:
        gc.enable()
    assert report["twice"].value == float((Fraction(1e300) + Fraction(1e-300)) * 2)
    cause = "the denominator `(n - n)` is zero"
    assert report["after_zero"].reason == f"`by_zero` is undefined: {cause}"
    assert report["no_min"].value is None and report["deep"].value is None
    assert freed_by_the_collector == 0
