"""exact_sum: the same bits for any order, padding or grouping; within an ulp of exact."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from steptally.client.loss import exact_sum  # noqa: E402
from steptally.client.loss.exact_sum import exact_sums  # noqa: E402

pytestmark = pytest.mark.torch

finite = st.floats(
    allow_nan=False, allow_infinity=False, width=64, min_value=-1e200, max_value=1e200
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(finite, min_size=1, max_size=300),
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
    exact = sum(map(Fraction, values))
    if abs(exact) >= 2.0**-900:  # below, the grid is coarser than the values (documented)
        assert abs(Fraction(float(a)) - exact) <= Fraction(2 * math.ulp(float(exact)))
    # rows of a 2-D input are summed independently
    assert torch.equal(exact_sum(torch.stack([x, x]))[1], a)


def test_non_finite_values_are_data():
    inf, nan = float("inf"), float("nan")
    assert float(exact_sum(torch.tensor([1.0, inf]))) == inf
    assert math.isnan(float(exact_sum(torch.tensor([inf, -inf]))))
    assert math.isnan(float(exact_sum(torch.tensor([1.0, nan]))))


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
