"""exact_sum: the same bits for any order, padding or grouping; within an ulp of exact,
however the values cancel or how far apart their magnitudes are."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from steptally.client.loss import exact_sum  # noqa: E402
from steptally.client.loss.exact_sum import exact_sums, limbs  # noqa: E402

pytestmark = pytest.mark.torch

finite = st.floats(
    allow_nan=False, allow_infinity=False, width=64, min_value=-1e300, max_value=1e300
)
# values that cancel: x and -x both present, so the sum is far below the largest magnitude
cancelling = st.lists(finite, min_size=1, max_size=20).map(lambda xs: xs + [-x for x in xs[1:]])


def _within_an_ulp(got: float, values: list[float]) -> bool:
    exact = sum(map(Fraction, values))
    return abs(Fraction(got) - exact) <= Fraction(math.ulp(float(exact)))


# hypothesis's finds against the binned sum this replaces, and cancellation cases around them
@pytest.mark.parametrize(
    "values",
    [
        [1.0, 1e200, -1e200],
        [1.0, 1e100, -1e100, 1e200, -1e200],
        [-1.0],
        [2.0**-1074, -(2.0**-1074), 2.0**-1074],
        [1e300, 1.0, -1e300, 2.0**-1074],
        [2.0**52 + 1, -(2.0**52), 0.5, 2.0**-60],
        [1.7976931348623157e308, -1.7976931348623157e308, 1e-300],
    ],
)
def test_small_terms_survive_cancellation(values):
    got = float(exact_sum(torch.tensor(values, dtype=torch.float64)))
    assert _within_an_ulp(got, values)
    assert got == float(sum(map(Fraction, values)))  # these are all correctly rounded


@settings(max_examples=200, deadline=None)
@given(st.lists(finite, min_size=1, max_size=60) | cancelling)
def test_limbs_are_the_exact_sum(values):
    weights = [Fraction(2) ** (32 * j - 1074) for j in range(66)]
    got = limbs(torch.tensor(values, dtype=torch.float64)).tolist()
    assert sum(Fraction(limb) * w for limb, w in zip(got, weights, strict=True)) == sum(
        map(Fraction, values)
    )
    assert all(-1 <= limb <= 2**32 for limb in got[:-1])


@settings(max_examples=150, deadline=None)
@given(
    st.lists(finite, min_size=1, max_size=300) | cancelling,
    st.randoms(use_true_random=False),
    st.integers(0, 40),
)
def test_order_and_padding_do_not_change_a_bit(values, rnd, pad):
    x = torch.tensor(values, dtype=torch.float64)
    shuffled = list(values)
    rnd.shuffle(shuffled)
    y = torch.tensor(shuffled + [0.0] * pad, dtype=torch.float64)
    a, b = exact_sum(x), exact_sum(y)
    assert torch.equal(a, b)
    assert _within_an_ulp(float(a), values)
    # rows of a 2-D input are summed independently
    assert torch.equal(exact_sum(torch.stack([x, x]))[1], a)


def test_non_finite_values_are_data():
    inf, nan = float("inf"), float("nan")
    assert float(exact_sum(torch.tensor([1.0, inf]))) == inf
    assert math.isnan(float(exact_sum(torch.tensor([inf, -inf]))))
    assert math.isnan(float(exact_sum(torch.tensor([1.0, nan]))))
    # an exact sum beyond the float64 range is infinite; one inside it is not, even when
    # adding the values in order overflows
    big = 1.7976931348623157e308
    assert float(exact_sum(torch.tensor([big, big], dtype=torch.float64))) == inf
    assert float(exact_sum(torch.tensor([big, big, -big], dtype=torch.float64))) == big


def test_gradient_is_one():
    x = torch.randn(4, 9, requires_grad=True)
    exact_sum(x).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.ones_like(x))


def test_stacked_rows_keep_their_own_bits_and_gradient():
    g = torch.Generator().manual_seed(5)
    rows = {
        "small": torch.randn(300, generator=g, dtype=torch.float64) * 1e-9,
        "big": torch.randn(300, generator=g, dtype=torch.float64) * 1e12,
        "grad": torch.randn(300, generator=g, dtype=torch.float64).requires_grad_(True),
        "inf": torch.tensor([1.0, float("inf")] * 150, dtype=torch.float64),
    }
    sums = exact_sums(rows)
    for name, row in rows.items():
        assert torch.equal(sums[name], exact_sum(row)), name
    sums["grad"].backward()
    assert torch.equal(rows["grad"].grad, torch.ones(300, dtype=torch.float64))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(finite, cancelling.map(lambda xs: xs[0])), min_size=1, max_size=40))
def test_exact_parts_add_up_to_the_exact_sum_for_any_split(values: list[float]) -> None:
    from steptally.client.algebra.exact import expansion_of, round_scaled, scaled_int
    from steptally.client.loss.exact_sum import exact_parts

    exact = sum(map(scaled_int, values))
    parts = exact_parts(torch.tensor(values, dtype=torch.float64))
    assert parts.shape == (66,)
    assert sum(map(scaled_int, parts.tolist())) == exact  # every part exact, nothing lost
    terms = expansion_of(parts.tolist())
    assert terms[0] == round_scaled(exact)  # the correctly rounded sum comes first
    cut = len(values) // 2
    halves = [exact_parts(torch.tensor(h or [0.0], dtype=torch.float64)).tolist() for h in
              (values[:cut], values[cut:])]  # fmt: skip
    assert expansion_of(halves[0] + halves[1]) == terms  # a split adds to the same expansion


def test_exact_parts_of_a_non_finite_row_are_its_ieee_sum() -> None:
    from steptally.client.loss.exact_sum import exact_parts

    rows = torch.tensor([[1.0, math.inf, 2.0], [math.inf, -math.inf, 0.0], [1.0, 2.0, 3.0]])
    parts = exact_parts(rows.double())
    assert parts[0, -1].item() == math.inf and parts[0, :-1].abs().sum().item() == 0.0
    assert math.isnan(parts[1, -1].item())
    assert parts[2].sum().item() == 6.0
