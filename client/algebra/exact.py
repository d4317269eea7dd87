"""Exact, mergeable partial states, one per metric kind.

A ``sum`` keeps an integer super-accumulator: every finite float64 is an integer
multiple of 2**-1074, so the sum of any number of them, scaled by 2**1074, is an
exact Python integer. Non-finite values are counted beside it, never dropped.
A ``count`` keeps an exact integer. ``min`` and ``max`` keep the extreme, with
NaN absorbing and ``-0.0 < 0.0`` so that the result never depends on order.

Rounding to float64 happens once, in :meth:`value`, and nowhere else. Merging two
states never changes a bit of either, so the same state serves one microbatch, a
rank, a replica and a shard.

A sum fragment may carry its value *exactly*, as a float64 expansion: a few
non-overlapping finite floats, largest first, whose real sum is the value and whose
first term is that value correctly rounded (:func:`expansion`). The state adds every
term; a plain float is a one-term expansion.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

SCALE_BITS = 1074
_SCALE = 1 << SCALE_BITS
#: the most terms an expansion may have (a float64 needs at most 40)
MAX_TERMS = 64


def scaled_int(x: float) -> int:
    """The finite float ``x`` as an exact integer multiple of 2**-1074."""
    num, den = x.as_integer_ratio()
    return num << (SCALE_BITS + 1 - den.bit_length())


def round_scaled(acc: int) -> float:
    """``acc * 2**-1074`` rounded once to the nearest float64, ties to even."""
    try:
        return acc / _SCALE  # int / int true division is correctly rounded
    except OverflowError:
        return math.inf if acc > 0 else -math.inf


def expansion(acc: int) -> tuple[float, ...]:
    """``acc * 2**-1074`` as its canonical expansion: the correctly rounded value, then
    the correctly rounded remainder, until nothing remains (``(0.0,)`` for 0). Terms do
    not overlap, so there are at most 40. Beyond the float64 range: ``(±inf,)``."""
    terms: list[float] = []
    while acc or not terms:
        term = round_scaled(acc)
        if not math.isfinite(term):
            return (term,)
        terms.append(term)
        acc -= scaled_int(term)
    return tuple(terms)


def expansion_of(values: Sequence[float]) -> tuple[float, ...]:
    """The canonical :func:`expansion` of the exact sum of ``values``; with an inf or a
    NaN among them, their IEEE sum alone."""
    nonzero = [v for v in values if v]
    if not all(map(math.isfinite, nonzero)):
        return (sum(nonzero),)
    return expansion(_exact_finite_sum(nonzero))


def _exact_finite_sum(values: list[float], first: float | None = None) -> int:
    """Exact scaled sum of finite floats, at C speed for the common case.

    ``math.fsum`` returns the correctly rounded sum; subtracting it and summing
    again yields the rounded residual, until the residual is exactly zero. The
    parts found are exact and few (usually one or two passes). ``first``, when
    given, is ``math.fsum(values)`` already computed by the caller.
    """
    acc = 0
    work = list(values)
    try:
        while True:
            part = math.fsum(work) if first is None else first
            first = None
            if part == 0.0:
                return acc
            acc += scaled_int(part)
            work.append(-part)
    except OverflowError:  # an intermediate sum left the float range
        return sum(scaled_int(v) for v in values)


@dataclass(slots=True)
class SumState:
    """Exact partial sum; ``n`` counts the values folded in."""

    acc: int = 0
    n: int = 0
    nan: int = 0
    pos_inf: int = 0
    neg_inf: int = 0

    def add_many(self, values: Sequence[float], fragments: int | None = None) -> None:
        """Fold ``values`` in; they count as ``fragments`` values (default: one each), so
        the terms of expansions count once per fragment."""
        total: float | None = None
        try:
            total = math.fsum(values)
            clean = math.isfinite(total)
        except OverflowError:  # partial sums left the float range (NaN or inf may be there too)
            clean, total = all(map(math.isfinite, values)), None
        except ValueError:  # both infinities
            clean = False
        if clean:
            finite: list[float] = list(values)
        else:  # a NaN or infinity is among the values: count them apart
            finite = []
            for v in values:
                if math.isfinite(v):
                    finite.append(v)
                elif v != v:
                    self.nan += 1
                elif v > 0:
                    self.pos_inf += 1
                else:
                    self.neg_inf += 1
        self.acc += _exact_finite_sum(finite, total if clean else None)
        self.n += len(values) if fragments is None else fragments

    def add(self, value: float) -> None:
        self.add_many((value,))

    def merge(self, other: SumState) -> None:
        self.acc += other.acc
        self.n += other.n
        self.nan += other.nan
        self.pos_inf += other.pos_inf
        self.neg_inf += other.neg_inf

    @property
    def non_finite(self) -> int:
        return self.nan + self.pos_inf + self.neg_inf

    def exact(self) -> Fraction | float:
        """The exact value: a :class:`Fraction`, or a non-finite float."""
        special = self._non_finite()
        return Fraction(self.acc, _SCALE) if special is None else special

    def value(self) -> float:
        """The exact value rounded once (no :class:`Fraction` made: reducing one of a
        2,100-bit integer costs ~5 µs)."""
        special = self._non_finite()
        return round_scaled(self.acc) if special is None else special

    def _non_finite(self) -> float | None:
        if self.nan or (self.pos_inf and self.neg_inf):
            return math.nan
        if self.pos_inf:
            return math.inf
        if self.neg_inf:
            return -math.inf
        return None


@dataclass(slots=True)
class CountState:
    """Exact integer total of non-negative integer values."""

    total: int = 0
    n: int = 0

    def add_many(self, values: Iterable[float]) -> None:
        for v in values:
            self.total += int(v)
            self.n += 1

    def add(self, value: float) -> None:
        self.total += int(value)
        self.n += 1

    def merge(self, other: CountState) -> None:
        self.total += other.total
        self.n += other.n

    def exact(self) -> Fraction:
        return Fraction(self.total)

    def value(self) -> float:
        return round_scaled(self.total << SCALE_BITS)


def _signbit(x: float) -> bool:
    return math.copysign(1.0, x) < 0


@dataclass(slots=True)
class ExtremeState:
    """Minimum or maximum; NaN anywhere makes it NaN; ``None`` until a value arrives."""

    is_max: bool
    best: float | None = None
    n: int = 0
    nan: int = 0

    def _better(self, a: float, b: float) -> float:
        if a == b:  # only the sign of a zero can differ: -0.0 is the smaller
            return b if _signbit(a) == self.is_max else a
        if self.is_max:
            return a if a > b else b
        return a if a < b else b

    def add_many(self, values: Iterable[float]) -> None:
        """Fold many values in at C speed; the same result as adding them one by one."""
        vals = list(values)
        if not vals:
            return
        nans = sum(map(math.isnan, vals))
        if nans:
            vals = [v for v in vals if v == v]
        self.n += nans
        self.nan += nans
        if not vals:
            return
        self.n += len(vals)
        best = max(vals) if self.is_max else min(vals)
        if best == 0.0:  # both zeros may be there: -0.0 is the smaller
            negative = any(_signbit(v) for v in vals if v == 0.0)
            positive = any(not _signbit(v) for v in vals if v == 0.0)
            best = 0.0 if (positive if self.is_max else not negative) else -0.0
        self.best = best if self.best is None else self._better(self.best, best)

    def add(self, value: float) -> None:
        self.n += 1
        if value != value:
            self.nan += 1
        elif self.best is None:
            self.best = value
        else:
            self.best = self._better(self.best, value)

    def merge(self, other: ExtremeState) -> None:
        self.n += other.n
        self.nan += other.nan
        if other.best is not None:
            self.best = other.best if self.best is None else self._better(self.best, other.best)

    @property
    def non_finite(self) -> int:
        return self.nan + (0 if self.best is None or math.isfinite(self.best) else 1)

    def exact(self) -> Fraction | float | None:
        if self.nan:
            return math.nan
        if self.best is None:
            return None
        return Fraction(self.best) if math.isfinite(self.best) else self.best

    def value(self) -> float | None:
        if self.nan:
            return math.nan
        return self.best
