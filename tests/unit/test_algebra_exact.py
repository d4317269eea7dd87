"""The exactness contract: every value is the exact result rounded once, whatever the
sharding, merge order or batching."""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steptally.client.algebra import MetricSpec, StepAccumulator, combine
from steptally.client.algebra.exact import ExtremeState, SumState, round_scaled, scaled_int

finite = st.floats(allow_nan=False, allow_infinity=False)
# Magnitudes far apart, so that a naive float sum loses low bits.
adversarial = st.one_of(
    finite,
    st.sampled_from([1e17, -1e17, 1.0, -1.0, 1e308, -1e308, 5e-324, 2.0**-1074, 1e-300]),
)


def exact_sum(values: list[float]) -> float:
    """The reference: the sum over Fractions, rounded once by Fraction -> float; NaN and
    the infinities as IEEE arithmetic has them in any order."""
    if any(math.isnan(v) for v in values) or {math.inf, -math.inf} <= set(values):
        return math.nan
    for inf in (math.inf, -math.inf):
        if inf in values:
            return inf
    total = sum((Fraction(v) for v in values), Fraction(0))
    try:
        return float(total)
    except OverflowError:
        return math.inf if total > 0 else -math.inf


def shards(values: list[float], cuts: list[int]) -> list[list[float]]:
    points = sorted({c % (len(values) + 1) for c in cuts})
    out, start = [], 0
    for p in [*points, len(values)]:
        out.append(values[start:p])
        start = p
    return out


with_non_finite = st.one_of(adversarial, st.sampled_from([math.nan, math.inf, -math.inf]))


@settings(max_examples=300)
@given(st.lists(with_non_finite, max_size=60))
def test_sum_is_the_correctly_rounded_exact_sum(values: list[float]) -> None:
    state = SumState()
    state.add_many(values)
    got, expected = state.value(), exact_sum(values)
    assert (math.isnan(got) and math.isnan(expected)) or got == expected
    one_by_one = SumState()
    for v in values:
        one_by_one.add(v)
    assert one_by_one == state


def test_catastrophic_cancellation_across_ranks() -> None:
    spec = MetricSpec.build({"x": "sum"})
    ranks = [[{"x": 1e17}], [{"x": 1.0}], [{"x": -1e17}]]
    accs = []
    for frags in ranks:
        acc = StepAccumulator(spec)
        for f in frags:
            acc.add(f)
        accs.append(acc)
    total = StepAccumulator(spec)
    for acc in reversed(accs):
        total.merge(acc)
    assert total.report()["x"].value == 1.0
    assert (1e17 + 1.0) - 1e17 == 0.0  # what a naive float sum reports


@settings(max_examples=200)
@given(
    st.lists(adversarial, min_size=1, max_size=40),
    st.lists(st.integers(), max_size=6),
    st.randoms(use_true_random=False),
)
def test_any_sharding_and_merge_order_is_bit_identical(
    values: list[float], cuts: list[int], rnd: random.Random
) -> None:
    single = SumState()
    single.add_many(values)
    parts = []
    for shard in shards(values, cuts):
        s = SumState()
        rnd.shuffle(shard)
        for v in shard:  # one value at a time, as single fragments arrive
            s.add(v)
        parts.append(s)
    rnd.shuffle(parts)
    merged = SumState()
    for p in parts:
        merged.merge(p)
    assert merged == single
    assert math.copysign(1, merged.value()) == math.copysign(1, single.value())


@given(st.lists(adversarial, max_size=30))
def test_merge_identity_and_commutativity(values: list[float]) -> None:
    a, b = SumState(), SumState()
    a.add_many(values[::2])
    b.add_many(values[1::2])
    ab, ba, a0 = SumState(), SumState(), SumState()
    for x, y, out in ((a, b, ab), (b, a, ba)):
        out.merge(x)
        out.merge(y)
    a0.merge(a)
    a0.merge(SumState())
    assert ab == ba
    assert a0 == a


@given(st.lists(finite, min_size=1, max_size=30), st.lists(finite, min_size=1, max_size=30))
def test_derived_quotient_is_exact_quotient_rounded_once(
    num: list[float], den: list[float]
) -> None:
    spec = MetricSpec.build({"a": "sum", "b": "sum"}, {"q": "a / b"})
    frags = [{"a": v} for v in num] + [{"b": v} for v in den]
    result = combine(spec, frags)["q"]
    exact_den = sum((Fraction(v) for v in den), Fraction(0))
    if exact_den == 0:
        assert result.value is None
        assert "denominator" in (result.reason or "")
        return
    q = sum((Fraction(v) for v in num), Fraction(0)) / exact_den
    try:
        expected = float(q)
    except OverflowError:
        expected = math.inf if q > 0 else -math.inf
    assert result.value == expected


def test_quotient_of_exact_sums_differs_from_quotient_of_rounded_sums() -> None:
    # a = 1 + 2**-53 (not representable: the rounded sum is 1.0), b = 3.
    spec = MetricSpec.build({"a": "sum", "b": "count"}, {"q": "a / b"})
    result = combine(spec, [{"a": 1.0, "b": 3}, {"a": 2.0**-53}])["q"].value
    assert result == float(Fraction(1) / 3 + Fraction(1, 3 * 2**53))
    assert result != 1.0 / 3.0


def test_scaled_int_round_trips_every_kind_of_float() -> None:
    for x in [0.0, 1.0, -2.5, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 0.1]:
        assert Fraction(scaled_int(x), 2**1074) == Fraction(x)
        assert round_scaled(scaled_int(x)) == x


def test_sum_past_the_float_range_rounds_to_infinity() -> None:
    state = SumState()
    state.add_many([1.7976931348623157e308, 1.7976931348623157e308, -1e308])
    assert state.value() == exact_sum([1.7976931348623157e308, 1.7976931348623157e308, -1e308])
    big = SumState()
    big.add_many([1.7976931348623157e308] * 2)
    assert big.value() == math.inf


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([1.0, math.nan, 2.0], math.nan),
        ([1.0, math.inf], math.inf),
        ([-math.inf, 3.0], -math.inf),
        ([math.inf, -math.inf], math.nan),
    ],
)
def test_non_finite_values_are_kept_and_propagate(values: list[float], expected: float) -> None:
    state = SumState()
    for v in values:
        state.add(v)
    got = state.value()
    assert (math.isnan(got) and math.isnan(expected)) or got == expected
    assert state.non_finite == sum(not math.isfinite(v) for v in values)
    assert state.n == len(values)


@given(st.lists(st.floats(allow_nan=True), min_size=1, max_size=20), st.randoms())
def test_extremes_do_not_depend_on_order(values: list[float], rnd: random.Random) -> None:
    for is_max in (False, True):
        a, b = ExtremeState(is_max), ExtremeState(is_max)
        a.add_many(values)
        shuffled = list(values)
        rnd.shuffle(shuffled)
        half = len(shuffled) // 2
        b1, b2 = ExtremeState(is_max), ExtremeState(is_max)
        b1.add_many(shuffled[:half])
        b2.add_many(shuffled[half:])
        b.merge(b2)
        b.merge(b1)
        va, vb = a.value(), b.value()
        assert va is not None and vb is not None
        if any(math.isnan(v) for v in values):
            assert math.isnan(va) and math.isnan(vb)
        else:
            assert va == (max(values) if is_max else min(values))
            assert math.copysign(1, va) == math.copysign(1, vb)


def test_signed_zeros_are_ordered() -> None:
    lo, hi = ExtremeState(False), ExtremeState(True)
    for v in (0.0, -0.0):
        lo.add(v)
        hi.add(v)
    low, high = lo.value(), hi.value()
    assert low is not None and high is not None
    assert (low, math.copysign(1, low)) == (0.0, -1.0)
    assert (high, math.copysign(1, high)) == (0.0, 1.0)


@given(st.lists(st.floats(), max_size=30), st.booleans())
def test_bulk_extremes_equal_one_by_one(values: list[float], is_max: bool) -> None:
    bulk, single = ExtremeState(is_max), ExtremeState(is_max)
    bulk.add(1.0)
    single.add(1.0)
    bulk.add_many(values)
    for v in values:
        single.add(v)
    assert (bulk.n, bulk.nan) == (single.n, single.nan)
    a, b = bulk.value(), single.value()
    assert a is not None and b is not None
    assert (math.isnan(a) and math.isnan(b)) or (
        a == b and math.copysign(1, a) == math.copysign(1, b)
    )


@pytest.mark.parametrize(
    "values",
    [
        [1e308, 1e308, math.nan],
        [1e308, 1e308, -1e308, math.inf],
        [-1e308, -1e308, math.inf, 1.0],
    ],
)
def test_overflowing_partial_sums_beside_non_finite_values(values: list[float]) -> None:
    state = SumState()
    state.add_many(values)
    one_by_one = SumState()
    for v in values:
        one_by_one.add(v)
    assert state == one_by_one
    assert state.non_finite == 1
    expected = values[-1] if not math.isfinite(values[-1]) else values[-2]
    got = state.value()
    assert (math.isnan(got) and math.isnan(expected)) or got == expected


@given(st.lists(adversarial, max_size=30))
def test_expansion_is_exact_canonical_and_non_overlapping(values: list[float]) -> None:
    from steptally.client.algebra.exact import expansion

    acc = sum(map(scaled_int, values))
    terms = expansion(acc)
    if math.isinf(terms[0]):  # beyond the float64 range
        assert terms == (round_scaled(acc),)
        return
    assert terms[0] == round_scaled(acc)  # the first term is the correctly rounded sum
    assert sum(map(scaled_int, terms)) == acc  # the terms sum to it exactly
    assert len(terms) <= 40
    for big, small in itertools.pairwise(terms):
        assert abs(small) <= math.ulp(big) / 2  # no overlap, largest first
    state = SumState()
    state.add_many(terms, fragments=1)
    assert state.value() == round_scaled(acc) and state.n == 1


@settings(max_examples=200)
@given(
    st.lists(with_non_finite, max_size=30),
    st.lists(st.integers(min_value=0, max_value=2**53), max_size=10),
)
def test_a_reported_sum_or_count_is_its_exact_value_rounded_once(
    sums: list[float], counts: list[int]
) -> None:
    """``report`` rounds a sum or a count from its integer directly: the value is the
    exact one's, rounded once (the reference: a ``Fraction`` of the exact values), bit
    for bit, infinities past the float range and NaN as IEEE arithmetic has them."""
    spec = MetricSpec.build({"s": "sum", "c": "count", "empty": "sum"}, {"q": "s / c"})
    frags = [{"s": v} for v in sums] + [{"c": float(n)} for n in counts]
    report = combine(spec, frags)
    got, expected = report["s"].value, exact_sum(sums)
    assert got is not None and ((math.isnan(got) and math.isnan(expected)) or got == expected)
    assert math.copysign(1, got) == math.copysign(1, expected)
    assert report["c"].value == float(Fraction(sum(counts)))  # past 2**53: rounded once
    assert report["empty"].value == 0.0 and math.copysign(1, report["empty"].value) == 1
