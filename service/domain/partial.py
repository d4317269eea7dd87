"""The exact partial state of some fragments of a step, stored and merged (pure).

A batch's new fragments of one (step, rank) are combined at ingest, exactly, into a
:class:`~steptally.client.algebra.StepAccumulator` (:func:`of_cells`: the same
columns and guards as a finalisation); the store merges it into the pair's stored
partial, and a finalisation merges the step's partials instead of reading every
fragment. Merging exact states never changes a bit, so the result is the one the
fragments give, whatever the grouping.

The stored form (:func:`encode`) is JSON, one entry per metric with values:

* ``sum``: ``[m, shift, n, nan, +inf, -inf]``, the exact sum in units of 2**-1074
  being ``m << shift`` (``m`` in hex: it may exceed 64 bits), then the counts;
* ``count``: ``[total, n]``, the total in hex;
* ``min``/``max``: ``[bits, n, nan]``, ``bits`` the extreme's float64 bit pattern as a
  signed integer (None while only NaN arrived).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from steptally.client.algebra import Kind, MetricSpec, StepAccumulator
from steptally.client.algebra.exact import CountState, ExtremeState, SumState
from steptally.service.domain import packing
from steptally.service.domain.run import RunRecord

_F64 = struct.Struct("<d")
_I64 = struct.Struct("<q")


def of_cells(run: RunRecord, cells: Sequence[packing.Cell]) -> StepAccumulator:
    """The exact partial state of ``cells``, packed over ``run``'s columns."""
    acc = StepAccumulator(run.spec)
    index = {name: j for j, name in enumerate(run.columns)}
    guards = {index[m]: index[g] for m, g in run.spec.guards.items()}
    table = packing.columns(cells, len(run.columns), guards)
    tails = packing.tail_columns(cells, len(run.columns))
    for name, column, tail in zip(run.columns, table, tails, strict=True):
        acc.add_column(name, column, tail)
    return acc


def _sum(s: SumState) -> list[Any]:
    shift = (s.acc & -s.acc).bit_length() - 1 if s.acc else 0
    return [hex(s.acc >> shift), shift, s.n, s.nan, s.pos_inf, s.neg_inf]


def _extreme(s: ExtremeState) -> list[Any]:
    bits = None if s.best is None else _I64.unpack(_F64.pack(s.best))[0]
    return [bits, s.n, s.nan]


def encode(acc: StepAccumulator) -> bytes:
    """The stored form of ``acc`` (see the module docstring)."""
    out: dict[str, list[Any]] = {}
    for name, state in acc.states.items():
        if isinstance(state, SumState):
            out[name] = _sum(state)
        elif isinstance(state, CountState):
            out[name] = [hex(state.total), state.n]
        else:
            out[name] = _extreme(state)
    return orjson.dumps(out)


def decode(spec: MetricSpec, blob: bytes) -> StepAccumulator:
    """The partial state stored as ``blob`` (:func:`encode`), for a run of ``spec``."""
    acc = StepAccumulator(spec)
    for name, v in orjson.loads(blob).items():
        kind = spec.metrics[name]
        if kind is Kind.SUM:
            acc.states[name] = SumState(int(v[0], 16) << v[1], v[2], v[3], v[4], v[5])
        elif kind is Kind.COUNT:
            acc.states[name] = CountState(int(v[0], 16), v[1])
        else:
            best = None if v[0] is None else _F64.unpack(_I64.pack(v[0]))[0]
            acc.states[name] = ExtremeState(kind is Kind.MAX, best, v[1], v[2])
    return acc


def merged(spec: MetricSpec, stored: Iterable[bytes]) -> StepAccumulator:
    """Every partial of ``stored`` merged into one state (exactly, in any order)."""
    acc = StepAccumulator(spec)
    for blob in stored:
        acc.merge(decode(spec, blob))
    return acc
