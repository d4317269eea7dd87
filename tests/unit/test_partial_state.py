"""Exact partial states: the compiled kernel and the Python codec give the same bytes,
merging never changes a bit, and the result is the single-pass exact value."""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steptally.client.algebra import MetricResult, MetricSpec, StepAccumulator
from steptally.client.algebra.exact import CountState, SumState
from steptally.client.algebra.expression import Undefined
from steptally.service.domain import packing, partial
from steptally.service.domain.run import RunRecord

KINDS = {"a": "sum", "b": "sum", "n": "count", "g": "count", "lo": "min", "hi": "max"}
SPEC = MetricSpec.from_json({"metrics": KINDS, "guards": {"hi": "g"}})
RUN = RunRecord(1, "r", 4, SPEC, 60.0, 0.0, tuple(KINDS))
WIDTH = len(KINDS)
kernel = partial.kernel

special = st.sampled_from(
    [0.0, -0.0, math.nan, math.inf, -math.inf, 5e-324, -5e-324, 2.0**-1022, 1.7976931348623157e308]
)
anyfloat = st.one_of(special, st.floats(allow_nan=False, allow_infinity=False), special)
count = st.one_of(st.integers(0, 7), st.integers(0, 2**63 - 1)).map(float)


@st.composite
def fragments(draw: st.DrawFn, most: int = 6) -> list[packing.Cell]:
    out = []
    for _ in range(draw(st.integers(0, most))):
        row = [draw(anyfloat), draw(anyfloat), draw(count), draw(count)]
        row += [draw(anyfloat), draw(anyfloat)]
        out.append((struct.pack(f"<{WIDTH}d", *row), None, None))
    return out


def python_state(cells: list[packing.Cell]) -> bytes:
    return partial.encode(RUN, partial.of_cells(RUN, cells))


needs_kernel = pytest.mark.skipif(kernel is None, reason="the compiled kernel is not built")


def test_the_install_built_the_kernel() -> None:
    # the project's own install compiles it on these machines; without it the service
    # falls back to Python, several times slower (bench/README.md, Scale)
    assert kernel is not None


@needs_kernel
@settings(max_examples=400, deadline=None)
@given(fragments())
def test_kernel_combine_gives_the_python_bytes(cells: list[packing.Cell]) -> None:
    assert partial.state_of(RUN, cells) == python_state(cells)


@needs_kernel
@settings(max_examples=200, deadline=None)
@given(st.lists(fragments(3), min_size=1, max_size=5))
def test_kernel_merge_gives_the_python_bytes(parts: list[list[packing.Cell]]) -> None:
    states = [python_state(cells) for cells in parts]
    acc = partial.decode(RUN, states[0])
    for state in states[1:]:
        acc.merge(partial.decode(RUN, state))
    assert partial.merge(RUN, states) == partial.encode(RUN, acc)


@settings(max_examples=200, deadline=None)
@given(st.lists(fragments(3), min_size=1, max_size=5))
def test_any_split_merges_to_the_single_pass_state(parts: list[list[packing.Cell]]) -> None:
    everything = [cell for cells in parts for cell in cells]
    merged = partial.merge(RUN, [partial.state_of(RUN, cells) for cells in parts])
    assert merged == python_state(everything)
    assert partial.encode(RUN, partial.decode(RUN, merged)) == merged


def test_values_are_exact_and_rounded_once() -> None:
    rows = [
        [1e17, 3.0, 2, 0, 5.0, -1.0],
        [3.0, 2.0**-1074, 3, 1, -0.0, 9.0],
        [-1e17, 0, 1, 0, 0.0, 99.0],
    ]
    cells = [(struct.pack(f"<{WIDTH}d", *map(float, row)), None, None) for row in rows]
    acc = partial.decode(RUN, partial.state_of(RUN, cells))
    report = acc.report()
    assert report["a"].value == 3.0  # added in order as floats: 0.0 (1e17 + 3 rounds to 1e17)
    assert acc.states["a"].exact() == Fraction(3)
    assert acc.states["b"].exact() == Fraction(3) + Fraction(1, 2**1074)
    assert report["n"].value == 6.0 and report["lo"].value == -0.0
    assert report["hi"].value == 9.0  # only the fragment whose guard g > 0


def test_non_finite_values_are_counted_not_dropped() -> None:
    rows = [[math.nan, math.inf, 1, 1, math.nan, math.inf], [1.0, -math.inf, 0, 1, 2.0, 1.0]]
    cells = [(struct.pack(f"<{WIDTH}d", *row), None, None) for row in rows]
    state = partial.state_of(RUN, cells)
    assert state == python_state(cells)
    acc = partial.decode(RUN, state)
    a, b = acc.states["a"], acc.states["b"]
    assert (a.n, a.nan, a.pos_inf, a.neg_inf) == (2, 1, 0, 0)  # type: ignore[union-attr]
    assert (b.n, b.nan, b.pos_inf, b.neg_inf) == (2, 0, 1, 1)  # type: ignore[union-attr]
    assert math.isnan(acc.report()["lo"].value or 0.0)  # NaN anywhere makes a min NaN


def test_the_stored_form_is_the_documented_bytes() -> None:
    cells = [(struct.pack(f"<{WIDTH}d", 1.5, -(2.0**-1074), 7.0, 0.0, 3.0, 4.0), None, None)]
    state = partial.state_of(RUN, cells)
    # 1.5 in units of 2**-1074 is 3 << 1073: 1073 = 8 * 134 + 1, so m = 6, shift 134
    sum_a = struct.pack("<HBQ", 0, 0, 1) + struct.pack("<QQQ", 0, 0, 0)
    sum_a += struct.pack("<HH", 134, 1) + bytes([6])
    sum_b = struct.pack("<HBQ", 1, 0, 1) + struct.pack("<QQQ", 0, 0, 0)
    sum_b += struct.pack("<HH", 0, 1) + bytes([0xFF])
    n = struct.pack("<HBQ", 2, 1, 1) + struct.pack("<HH", 0, 1) + bytes([7])
    g = struct.pack("<HBQ", 3, 1, 1) + struct.pack("<HH", 0, 0)
    lo = struct.pack("<HBQ", 4, 2, 1) + struct.pack("<QBd", 0, 1, 3.0)
    # hi is guarded by g, which is 0: no value, so no entry
    assert state == struct.pack("<BH", 2, 5) + sum_a + sum_b + n + g + lo


def test_version_one_json_states_still_read_and_merge() -> None:
    v1 = orjson.dumps({"a": [hex(3), 1073, 1, 0, 0, 0], "n": [hex(7), 1], "lo": [None, 1, 1]})
    acc = partial.decode(RUN, v1)
    assert acc.states["a"].exact() == Fraction(3, 2)  # type: ignore[union-attr]
    cells = [(struct.pack(f"<{WIDTH}d", 1.0, 0.0, 1.0, 0.0, 2.0, 0.0), None, None)]
    merged = partial.decode(RUN, partial.merge(RUN, [v1, partial.state_of(RUN, cells)]))
    assert merged.states["a"].exact() == Fraction(5, 2)  # type: ignore[union-attr]
    assert merged.report()["n"].value == 8.0 and math.isnan(merged.report()["lo"].value or 0)


def test_cells_that_leave_columns_out_or_carry_tails_take_the_python_path() -> None:
    masked = packing.pack([1.0, 0.0, 2.0], b"\x01\x00\x01")
    tailed = packing.pack([1.0, 1.0], b"\x01\x01", {0: [2.0**-60]})
    state = partial.state_of(RUN, [masked, tailed])
    assert state == python_state([masked, tailed])
    assert partial.decode(RUN, state).states["a"].exact() == 2 + Fraction(1, 2**60)  # type: ignore[union-attr]


# sums whose carries reach past the digits their values added into: a borrow from the
# lowest digit to the highest, a sum that cancels to zero, a negative sum the width of
# one digit, a sum carried into the top digit
CARRIES = [
    [1.7976931348623157e308, -5e-324],
    [-1.7976931348623157e308, 5e-324],
    [5e-324, -5e-324],
    [-5e-324],
    [-(2.0**-1042)],
    [2.0**-1043, 2.0**-1043],
    [1.7976931348623157e308] * 3 + [-5e-324] * 3,
    [-1.7976931348623157e308] * 5 + [2.0**-600],
    [2.0**31 * 5e-324, 2.0**31 * 5e-324],
]


@needs_kernel
@pytest.mark.parametrize("terms", CARRIES)
def test_carries_past_the_digits_added_into_give_the_python_bytes(terms: list[float]) -> None:
    rows = [[x, -x, 0.0, 0.0, x, x] for x in terms]
    cells = [(struct.pack(f"<{WIDTH}d", *row), None, None) for row in rows]
    assert partial.state_of(RUN, cells) == python_state(cells)
    exact = partial.decode(RUN, partial.state_of(RUN, cells)).states["a"].exact()
    assert exact == sum(map(Fraction, terms))  # type: ignore[union-attr]


@needs_kernel
def test_a_million_adds_into_one_digit_give_the_python_bytes() -> None:
    """Past 10**6 adds the kernel resolves its carries midway (each digit held in
    int64 stays far from overflowing); the bytes are the same."""
    one = RunRecord(1, "r", 4, MetricSpec.from_json({"metrics": {"a": "sum"}}), 60.0, 0.0, ("a",))
    terms = [-(2.0**-1000), 2.0**-1001] * 500_001
    cells: list[packing.Cell] = [(struct.pack("<d", x), None, None) for x in terms]
    kinds, guards = one.layout
    state = bytes(kernel.combine(struct.pack(f"<{len(terms)}d", *terms), 1, kinds, guards))
    assert state == partial.encode(one, partial.of_cells(one, cells))
    exact = partial.decode(one, state).states["a"].exact()  # type: ignore[union-attr]
    assert exact == -500_001 * Fraction(2) ** -1001


@needs_kernel
def test_the_kernel_refuses_what_does_not_fit() -> None:
    kinds, guards = RUN.layout
    with pytest.raises(ValueError, match="do not fit"):
        kernel.combine(b"\x00" * 7, WIDTH, kinds, guards)
    with pytest.raises(ValueError, match="not a partial state"):
        kernel.merge([b"\x02\x01\x00"])
    with pytest.raises(ValueError, match="not a partial state"):
        kernel.merge([b"{}"])


# -- reported by the kernel ----------------------------------------------------------

DERIVED = {"mean": "a / n", "ratio": "b / a", "spread": "hi - lo", "twice": "mean * 2"}
RUN_D = RunRecord(
    1, "r", 4, MetricSpec.from_json({**SPEC.to_json(), "derived": DERIVED}), 60.0, 0.0, RUN.columns
)


def bits(value: float | None) -> object:
    """A reported value as its bits: -0.0 and 0.0 differ, every NaN is one."""
    if value is None or value != value:
        return value if value is None else "nan"
    return struct.pack("<d", value)


def report_bits(report: dict[str, MetricResult]) -> list[tuple[object, ...]]:
    return [
        (name, bits(r.value), r.reason, r.kind, r.n, r.non_finite) for name, r in report.items()
    ]


@needs_kernel
@settings(max_examples=300, deadline=None)
@given(st.lists(fragments(3), min_size=1, max_size=5))
def test_the_kernel_reports_the_python_bits(parts: list[list[packing.Cell]]) -> None:
    states = [partial.state_of(RUN_D, cells) for cells in parts]
    merged = partial.merged(RUN_D, states)
    assert isinstance(merged, partial.Merged)
    python = partial.decode(RUN_D, partial.merge(RUN_D, states))
    assert report_bits(merged.report()) == report_bits(python.report())
    for name in KINDS:
        try:
            want: object = python._exact(name)
        except Undefined as exc:
            want = exc.args
        try:
            got: object = merged.exact(name)
        except Undefined as exc:
            got = exc.args
        assert bits(got) == bits(want) if isinstance(want, float) else got == want


def sum_state(acc: int, nan: int = 0, pos: int = 0, neg: int = 0) -> bytes:
    """The stored form of one sum ``a`` of ``acc`` (units of 2**-1074) and one count
    ``n`` of the same integer."""
    state = StepAccumulator(SPEC)
    state.states["a"] = SumState(acc, 1, nan, pos, neg)
    state.states["n"] = CountState(abs(acc), 1)
    return partial.encode(RUN, state)


def python_rounded(acc: int) -> float:
    try:
        return acc / 2**1074
    except OverflowError:
        return math.inf if acc > 0 else -math.inf


# integers that round to a tie (half an ulp above a 53-bit significand), one above and
# one below it, anywhere in the float64 range and past it
ties = st.builds(
    lambda m, s, d, sign: sign * (((m << 1) | 1) << s) + d,
    st.integers(2**52, 2**53 - 1),
    st.integers(0, 2100),
    st.sampled_from([-1, 0, 1]),
    st.sampled_from([-1, 1]),
)
integers = st.one_of(
    st.integers(-(2**2200), 2**2200), st.integers(-(2**60), 2**60), ties, st.just(0)
)


@needs_kernel
@settings(max_examples=1000, deadline=None)
@given(integers)
def test_the_kernel_rounds_any_sum_and_count_as_python_divides(acc: int) -> None:
    merged = partial.merged(RUN, [sum_state(acc)])
    assert isinstance(merged, partial.Merged)
    report = merged.report()
    assert bits(report["a"].value) == bits(python_rounded(acc))
    assert bits(report["n"].value) == bits(python_rounded(abs(acc) << 1074))
    assert merged.exact("a") == Fraction(acc, 2**1074)
    assert merged.exact("n") == abs(acc)


@needs_kernel
@pytest.mark.parametrize(
    ("counts", "value"),
    [((1, 0, 0), math.nan), ((0, 1, 0), math.inf), ((0, 0, 2), -math.inf), ((0, 1, 1), math.nan)],
)
def test_the_kernel_reports_a_sum_that_holds_non_finite_values(
    counts: tuple[int, int, int], value: float
) -> None:
    merged = partial.merged(RUN, [sum_state(5, *counts)])
    a = merged.report()["a"]
    assert bits(a.value) == bits(value) and a.non_finite == sum(counts)
    assert bits(merged.exact("a")) == bits(value)  # type: ignore[arg-type]


@needs_kernel
def test_the_kernel_reports_metrics_without_values_as_python_does() -> None:
    cells = [(struct.pack(f"<{WIDTH}d", 1.0, 2.0, 1.0, 0.0, -0.0, 5.0), None, None)]
    merged = partial.merged(RUN_D, [partial.state_of(RUN_D, cells)])
    report = merged.report()
    python = partial.decode(RUN_D, partial.state_of(RUN_D, cells)).report()
    assert report_bits(report) == report_bits(python)
    assert (
        report["hi"].value is None and report["hi"].reason == "no fragment carried a value of `hi`"
    )
    assert report["spread"].value is None  # derived from an undefined max
    assert bits(report["lo"].value) == bits(0.0)  # the exact value of -0.0 is 0
    assert report["mean"].value == 1.0 and report["twice"].value == 2.0
