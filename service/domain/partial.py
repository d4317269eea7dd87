"""The exact partial state of some fragments of a step, stored and merged.

A batch's new fragments of one (step, rank) are combined at ingest, exactly, into a
partial state (:func:`state_of`: the same columns and guards as a finalisation); the
store merges it into the pair's stored state (:func:`merge`), and a finalisation merges
the step's states (:func:`merged`) instead of reading every fragment. Merging exact
states never changes a bit, so the result is the one the fragments give, whatever the
grouping.

The stored form is binary (version 2), keyed by the run's columns, in column order::

    u8 2, u16 entries, then per entry: u16 column, u8 kind (0 sum, 1 count, 2 min, 3 max),
    u64 n (values folded in), and
      sum:      u64 nan, u64 +inf, u64 -inf, integer   (the sum in units of 2**-1074)
      count:    integer                                (the total)
      min, max: u64 nan, u8 has, f64 best              (best's bits, 0 while none)
    integer: u16 shift, u16 length, then ``length`` bytes of the value / 256**shift,
             little-endian two's complement, as few as hold it (0 bytes: zero)

all little-endian. :mod:`._partial` (``_partial.c``, built by the project's install)
combines full-width fragments and merges states in C, byte for byte as this module
does in Python, which it falls back to when the extension is not built and for
fragments that leave cells out or carry exact sums' further terms.

Version 1, the JSON form of earlier releases (``{"metric": [...]}``, see
:func:`_decode_v1`), is still read.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from types import ModuleType
from typing import Any

import orjson

from steptally.client.algebra import Kind, MetricResult, StepAccumulator
from steptally.client.algebra.combine import Summary, no_value, reported
from steptally.client.algebra.exact import SCALE_BITS, CountState, ExtremeState, SumState
from steptally.client.algebra.expression import Exact, Undefined
from steptally.service.domain import packing
from steptally.service.domain.run import RunRecord

kernel: ModuleType | None
try:
    from steptally.service.domain import _partial as kernel
except ImportError:  # not built (no compiler at install): the same bytes, in Python
    kernel = None

VERSION = 2
_HEAD = struct.Struct("<BH")
_ENTRY = struct.Struct("<HBQ")
_SUM = struct.Struct("<QQQ")
_EXTREME = struct.Struct("<QBd")
_INTEGER = struct.Struct("<HH")
_F64 = struct.Struct("<d")
_I64 = struct.Struct("<q")


def of_cells(run: RunRecord, cells: Sequence[packing.Cell]) -> StepAccumulator:
    """The exact partial state of ``cells``, packed over ``run``'s columns, in Python."""
    acc = StepAccumulator(run.spec)
    index = run.column_of
    guards = {index[m]: index[g] for m, g in run.spec.guards.items()}
    table = packing.columns(cells, len(run.columns), guards)
    tails = packing.tail_columns(cells, len(run.columns))
    for name, column, tail in zip(run.columns, table, tails, strict=True):
        acc.add_column(name, column, tail)
    return acc


def state_of(run: RunRecord, cells: Sequence[packing.Cell]) -> bytes:
    """The stored form of the exact partial state of ``cells``."""
    width = 8 * len(run.columns)
    if kernel is not None and all(p is None and t is None and len(v) == width for v, p, t in cells):
        kinds, guards = run.layout
        joined = b"".join(v for v, _, _ in cells)
        return bytes(kernel.combine(joined, len(run.columns), kinds, guards))
    return encode(run, of_cells(run, cells))


def states_of(
    run: RunRecord, fragments: Mapping[tuple[int, int, int], packing.Cell]
) -> dict[tuple[int, int], tuple[int, bytes]]:
    """Per (step, rank) of ``fragments``: their number and their state's stored form."""
    pairs: dict[tuple[int, int], list[packing.Cell]] = {}
    for key, cell in fragments.items():
        pairs.setdefault(key[:2], []).append(cell)
    return {pair: (len(cells), state_of(run, cells)) for pair, cells in pairs.items()}


def merge(run: RunRecord, states: Sequence[bytes]) -> bytes:
    """Stored states merged into one stored state."""
    if kernel is not None and all(s[:1] == b"\x02" for s in states):
        return bytes(kernel.merge(states))
    return encode(run, _accumulated(run, states))


def merged(run: RunRecord, stored: Iterable[bytes]) -> StepAccumulator | Merged:
    """Every stored state of ``stored`` merged into one (exactly, in any order): by the
    kernel, reported there (:class:`Merged`), where it is built and every state is of
    version 2; else in Python."""
    blobs = [bytes(b) for b in stored]
    if kernel is not None and blobs and all(b[:1] == b"\x02" for b in blobs):
        return Merged(run, blobs)
    return _accumulated(run, blobs)


def _accumulated(run: RunRecord, stored: Iterable[bytes]) -> StepAccumulator:
    acc = StepAccumulator(run.spec)
    for blob in stored:
        acc.merge(decode(run, blob))
    return acc


class Merged:
    """Stored states merged by the kernel, each metric reported there
    (``_partial.report``: its value rounded once in C, its counts, its exact integer's
    bytes): what a finalisation evaluates, without a Python state made for every
    metric. :meth:`report` gives the bits :meth:`StepAccumulator.report` gives for the
    same states (``tests/unit/test_partial_state.py``), in half the instructions of a
    finalisation at 8 ranks (bench/README.md, Scale, stop 20)."""

    __slots__ = ("_columns", "spec")

    def __init__(self, run: RunRecord, blobs: Sequence[bytes]) -> None:
        assert kernel is not None
        self.spec = run.spec
        names = run.columns
        #: by metric: (kind, n, non_finite, value, exact integer's bytes or None)
        self._columns: dict[str, Column] = {names[e[0]]: e[1:] for e in kernel.report(blobs)}

    def report(self) -> dict[str, MetricResult]:
        """Every metric and derived value of the spec, each rounded once."""
        return reported(self.spec, self.summary, self.exact)

    def summary(self, name: str) -> Summary:
        """One metric as :func:`~steptally.client.algebra.combine.reported` takes it."""
        column = self._columns.get(name)
        if column is None:
            if self.spec.metrics.get(name) in _EXTREMES:
                return None, no_value(name), 0, 0
            return 0.0, None, 0, 0
        _, n, bad, value, exact = column
        if value is None:
            return None, no_value(name), n, bad
        if exact is None:  # a min or max: its exact value rounds a zero to 0.0
            value += 0.0
        return value, None, n, bad

    def exact(self, name: str) -> Exact:
        """A metric's exact value, as :meth:`StepAccumulator._exact` gives it."""
        column = self._columns.get(name)
        if column is None:
            if self.spec.metrics.get(name) in _EXTREMES:
                raise Undefined(no_value(name))
            return Fraction(0)
        kind, _, bad, value, exact = column
        if exact is None:  # a min or max
            if value is None:
                raise Undefined(no_value(name))
            return Fraction(value) if math.isfinite(value) else value
        if kind == 0 and bad:  # a sum that holds a NaN or an infinity: that, as it rounds
            assert value is not None
            return value
        total = int.from_bytes(exact, "little", signed=True)
        return Fraction(total, 1 << SCALE_BITS) if kind == 0 else Fraction(total)


_EXTREMES = (Kind.MIN, Kind.MAX)
#: a merged column as the kernel reports it, less its index
Column = tuple[int, int, int, float | None, bytes | None]


# -- the stored form ------------------------------------------------------------------


def _integer(v: int) -> bytes:
    if not v:
        return _INTEGER.pack(0, 0)
    shift = ((v & -v).bit_length() - 1) // 8
    m = v >> (8 * shift)
    length = ((m if m >= 0 else ~m).bit_length() + 8) // 8
    return _INTEGER.pack(shift, length) + m.to_bytes(length, "little", signed=True)


def encode(run: RunRecord, acc: StepAccumulator) -> bytes:
    """The stored form of ``acc`` (see the module docstring)."""
    column = run.column_of
    entries = sorted((column[name], state) for name, state in acc.states.items())
    out = [_HEAD.pack(VERSION, len(entries))]
    for col, state in entries:
        if isinstance(state, SumState):
            out += [
                _ENTRY.pack(col, 0, state.n),
                _SUM.pack(state.nan, state.pos_inf, state.neg_inf),
                _integer(state.acc),
            ]
        elif isinstance(state, CountState):
            out += [_ENTRY.pack(col, 1, state.n), _integer(state.total)]
        else:
            has = state.best is not None
            best = state.best if state.best is not None else 0.0
            out += [
                _ENTRY.pack(col, 3 if state.is_max else 2, state.n),
                _EXTREME.pack(state.nan, has, best),
            ]
    return b"".join(out)


def decode(run: RunRecord, blob: bytes) -> StepAccumulator:
    """The partial state stored as ``blob``, of either version."""
    if blob[:1] != b"\x02":
        return _decode_v1(run, blob)
    acc = StepAccumulator(run.spec)
    _, entries = _HEAD.unpack_from(blob, 0)
    at = _HEAD.size
    for _ in range(entries):
        col, kind, n = _ENTRY.unpack_from(blob, at)
        at += _ENTRY.size
        name = run.columns[col]
        if kind == 0:
            nan, pos, neg = _SUM.unpack_from(blob, at)
            total, at = _read_integer(blob, at + _SUM.size)
            acc.states[name] = SumState(total, n, nan, pos, neg)
        elif kind == 1:
            total, at = _read_integer(blob, at)
            acc.states[name] = CountState(total, n)
        else:
            nan, has, best = _EXTREME.unpack_from(blob, at)
            at += _EXTREME.size
            acc.states[name] = ExtremeState(kind == 3, best if has else None, n, nan)
    return acc


def _read_integer(blob: bytes, at: int) -> tuple[int, int]:
    shift, length = _INTEGER.unpack_from(blob, at)
    at += _INTEGER.size
    value = int.from_bytes(blob[at : at + length], "little", signed=True) << (8 * shift)
    return value, at + length


def _decode_v1(run: RunRecord, blob: bytes) -> StepAccumulator:
    """Version 1, JSON, one entry per metric: ``sum`` ``[hex m, shift, n, nan, +inf,
    -inf]`` (the sum in units of 2**-1074 being ``m << shift``), ``count`` ``[hex total,
    n]``, ``min``/``max`` ``[bits, n, nan]`` (the extreme's bits as a signed int64)."""
    spec = run.spec
    acc = StepAccumulator(spec)
    data: dict[str, list[Any]] = orjson.loads(blob)
    for name, v in data.items():
        kind = spec.metrics[name]
        if kind is Kind.SUM:
            acc.states[name] = SumState(int(v[0], 16) << v[1], v[2], v[3], v[4], v[5])
        elif kind is Kind.COUNT:
            acc.states[name] = CountState(int(v[0], 16), v[1])
        else:
            best = None if v[0] is None else _F64.unpack(_I64.pack(v[0]))[0]
            acc.states[name] = ExtremeState(kind is Kind.MAX, best, v[1], v[2])
    return acc
