"""What a spec's derived expressions cost as a whole, and the bound on evaluating them."""

from __future__ import annotations

from fractions import Fraction

import pytest

from steptally.client.algebra import ExpressionError, MetricSpec, combine
from steptally.client.algebra.expression import Budget, Cost, Undefined, cost, parse
from steptally.client.algebra.spec import SpecLimits


def test_cost_expands_derived_names() -> None:
    exprs = {"x": parse("a / n"), "y": parse("(x + 1) * x"), "z": parse("-y")}
    assert cost(exprs) == Cost(size=2 + 5 + 5, depth=7, chain=3)  # a name is a level


def test_a_squaring_chain_is_refused_before_any_evaluation() -> None:
    derived = {f"d{i + 1}": f"d{i} * d{i}" for i in range(40)}
    assert cost({n: parse(t) for n, t in derived.items()}, cap=10**6).size == 10**6
    with pytest.raises(ExpressionError, match="more than 10000 operands"):
        MetricSpec.build({"d0": "sum"}, derived, limits=SpecLimits())
    with pytest.raises(ExpressionError, match="more than 16 derived values in one chain"):
        MetricSpec.build({"d0": "sum"}, derived, limits=SpecLimits(max_size=2**50))


def test_depth_limit_counts_nesting_across_derived_names() -> None:
    derived = {"x": " + ".join(["a"] * 150), "y": " + ".join(["x"] * 60)}
    with pytest.raises(ExpressionError, match="more than 200 levels of nesting"):
        MetricSpec.build({"a": "sum"}, derived, limits=SpecLimits())


def test_long_chains_are_checked_without_recursion() -> None:
    derived = {f"d{i + 1}": f"d{i} + 1" for i in range(3000)}
    spec = MetricSpec.build({"d0": "sum"}, derived)  # no limits: a stored spec reads back
    assert cost(spec.parsed).chain == 3000
    derived["d1"] = "d3000 + 1"  # a cycle 3000 long
    with pytest.raises(ExpressionError, match="cycle: d1 -> d3000 -> d2999"):
        MetricSpec.build({"d0": "sum"}, derived)


def test_evaluation_of_a_stored_costly_spec_is_bounded_and_says_why() -> None:
    derived = {f"d{i + 1}": f"d{i} * d{i}" for i in range(40)}
    report = combine(MetricSpec.build({"d0": "sum"}, derived), [{"d0": 1.1}])
    assert report["d10"].value == float(Fraction(1.1) ** 1024)
    assert report["d40"].value is None
    assert report["d40"].reason == (
        "`d39` is undefined: an exact intermediate value has more than 65536 bits; "
        "simplify the expression"
    )


def test_the_budget_is_shared_by_every_expression_of_a_step() -> None:
    budget = Budget(units=3)
    budget.spend(Fraction(1), Fraction(2))
    budget.spend(Fraction(1), Fraction(2))
    budget.spend(Fraction(1), Fraction(2))
    with pytest.raises(Undefined, match="exceed the evaluation budget"):
        budget.spend(Fraction(1), Fraction(2))
