"""Numbers on the wire: non-finite values as proto3 strings, little-endian float64
blocks in base64, integer columns, and the terms of an exact sum (see
:mod:`steptally.client.wire`)."""

from __future__ import annotations

import base64
import binascii
import math
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from steptally.client.algebra.exact import MAX_TERMS

MAX_INT = 2**63 - 1
#: a value: a number, or the terms of an exact sum
Value = float | tuple[float, ...]
#: the proto3 JSON strings of the non-finite numbers, and what they decode to
NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_LITTLE = sys.byteorder == "little"


def f64_to_le_bytes(values: array[float]) -> bytes:
    """Float64 ``values`` as little-endian bytes (the wire's and the store's order)."""
    if _LITTLE:
        return values.tobytes()
    swapped = array("d", values)
    swapped.byteswap()
    return swapped.tobytes()


def f64_from_le_bytes(raw: bytes) -> array[float]:
    """Little-endian float64 bytes as native floats (``len(raw)`` a multiple of 8)."""
    values = array("d", raw)
    if not _LITTLE:
        values.byteswap()
    return values


class WireError(ValueError):
    """A body does not follow the wire format; ``where`` locates the offending item."""

    def __init__(self, where: str, message: str) -> None:
        self.where = where
        self.message = message
        super().__init__(f"{where}: {message}" if where else message)


def encode_number(x: float) -> float | str:
    """A float for JSON: finite as is, non-finite as its proto3 string."""
    if math.isfinite(x):
        return x
    return "NaN" if x != x else ("Infinity" if x > 0 else "-Infinity")


def decode_number(v: object, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise WireError(where, f"expected a number, got {type(v).__name__}")
    if isinstance(v, str):
        try:
            return NON_FINITE[v]
        except KeyError:
            raise WireError(
                where,
                f'{v!r} is not a number; non-finite values are "NaN", "Infinity" or "-Infinity"',
            ) from None
    try:
        return float(v)
    except OverflowError:
        raise WireError(where, f"the integer {v} is too large for a float64") from None


def decode_value(v: object, where: str) -> tuple[float, tuple[float, ...]]:
    """A number, or the terms of an exact sum as a JSON array: (first term, the rest)."""
    if not isinstance(v, list):
        return decode_number(v, where), ()
    if not 1 <= len(v) <= MAX_TERMS:
        raise WireError(where, f"an exact sum holds 1 to {MAX_TERMS} numbers, not {len(v)}")
    terms = [decode_number(x, f"{where}[{k}]") for k, x in enumerate(v)]
    tail = tuple(terms[1:])
    check_terms(terms[0], tail, where)
    return terms[0], tail


def check_terms(first: float, tail: Sequence[float], where: str) -> None:
    if tail and not (math.isfinite(first) and all(map(math.isfinite, tail))):
        raise WireError(
            where, "the terms of an exact sum must be finite; send a non-finite value alone"
        )


def decode_int(v: object, where: str, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= MAX_INT:
        raise WireError(where, f"expected an integer from {lo} to 2**63-1, got {v!r}")
    return v


def canonical_nan(values: array[float]) -> None:
    """Every NaN of ``values`` as the one NaN (``math.nan``), whatever its payload."""
    total = sum(values)  # NaN if any is (or if +inf meets -inf: then none is replaced)
    if total != total:
        for i, v in enumerate(values):
            if v != v:
                values[i] = math.nan


def decode_b64(v: object, where: str) -> bytes:
    if not isinstance(v, str):
        raise WireError(where, "must be a base64 string")
    try:
        return binascii.a2b_base64(v, strict_mode=True)
    except (binascii.Error, ValueError):
        raise WireError(where, "is not valid base64") from None


def encode_b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def int_column(
    data: Mapping[str, Any], key: str, n: int | None, block: str = "columnar"
) -> list[int]:
    col = data.get(key)
    if not isinstance(col, list):
        raise WireError(f"{block}.{key}", "must be a list of integers")
    if n is not None and len(col) != n:
        first = "step" if block == "columnar" else "cells"
        raise WireError(f"{block}.{key}", f"has {len(col)} entries, but {first} has {n}")
    if col and (set(map(type, col)) != {int} or min(col) < 0 or max(col) > MAX_INT):
        for i, v in enumerate(col):  # the first wrong entry, named
            if type(v) is not int or not 0 <= v <= MAX_INT:
                decode_int(v, f"{block}.{key}[{i}]")
    return col
