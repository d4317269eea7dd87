"""Arrays for PostgreSQL's pipelined statements, encoded in their binary wire form here.

The ingest path's statements (:data:`~.sql_statement.PIPELINE`) take every column of a
group's rows as one array parameter, about twenty a group. psycopg's list dumper
inspects each list element by element in Python before it encodes it (the element
type, its dimensions, each value's dumper): ~6 µs an array, most of the writer's
fixed cost a group beside the round trip (bench/README.md, Scale). The columns here
are of known types, so :func:`int8s`, :func:`int4s`, :func:`int2s`, :func:`float8s`
and :func:`byteas` build the form
that the server's ``array_recv`` reads — dimensions, element type, each element's
length and bytes, big-endian — in one ``struct`` call or one join, as a ``bytes``
subclass that a dumper registered for it passes on untouched, typed as the array it is.

A statement casts every parameter to its column's type (``%(name)b::BIGINT[]``), so
an array of another type is refused by the server, never misread.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from functools import cache
from typing import Any

import psycopg
from psycopg.adapt import Buffer, Dumper
from psycopg.pq import Format

_HEAD = struct.Struct(">iii")  # dimensions, has nulls, element type
_LENGTH = struct.Struct(">i")
_DIMENSION = struct.Struct(">ii")  # its length, its lower bound
_NULL = _LENGTH.pack(-1)
_FLOAT8 = struct.Struct(">id")  # an element's length, then the value


class PgArray(bytes):
    """A one-dimensional array's binary wire form."""

    __slots__ = ()
    element_oid = 0


class Int8Array(PgArray):
    __slots__ = ()
    element_oid = 20


class Int4Array(PgArray):
    __slots__ = ()
    element_oid = 23


class ByteaArray(PgArray):
    __slots__ = ()
    element_oid = 17


class Int2Array(PgArray):
    __slots__ = ()
    element_oid = 21


class Float8Array(PgArray):
    __slots__ = ()
    element_oid = 701


@cache
def _numbers(code: str, n: int) -> struct.Struct:
    """Header, one dimension of ``n`` from 1, then ``n`` (length, value) pairs."""
    return struct.Struct(">iiiii" + ("i" + code) * n)


def _empty(cls: type[PgArray]) -> PgArray:
    return cls(_HEAD.pack(0, 0, cls.element_oid))


def _fixed(cls: type[PgArray], code: str, size: int, values: Sequence[int]) -> PgArray:
    n = len(values)
    if not n:
        return _empty(cls)
    pairs = [size] * (2 * n)
    pairs[1::2] = values
    return cls(_numbers(code, n).pack(1, 0, cls.element_oid, n, 1, *pairs))


def _joined(cls: type[PgArray], values: Sequence[Any], elements: Iterable[bytes]) -> PgArray:
    """The array of ``values`` (None a null) from its elements' wire form, in order."""
    if not values:
        return _empty(cls)
    nulls = any(v is None for v in values)
    head = _HEAD.pack(1, int(nulls), cls.element_oid) + _DIMENSION.pack(len(values), 1)
    return cls(b"".join([head, *elements]))


def int8s(values: Sequence[int]) -> Int8Array:
    """``values`` as a ``BIGINT[]`` (each in the signed 64-bit range, or ``struct.error``)."""
    return _fixed(Int8Array, "q", 8, values)  # type: ignore[return-value]


def int4s(values: Sequence[int]) -> Int4Array:
    """``values`` as an ``INTEGER[]`` (each in the signed 32-bit range, or ``struct.error``)."""
    return _fixed(Int4Array, "i", 4, values)  # type: ignore[return-value]


def int2s(values: Sequence[int]) -> Int2Array:
    """``values`` as a ``SMALLINT[]`` (each in the signed 16-bit range, or ``struct.error``)."""
    return _fixed(Int2Array, "h", 2, values)  # type: ignore[return-value]


def float8s(values: Sequence[float | None]) -> Float8Array:
    """``values`` as a ``DOUBLE PRECISION[]``, None a null (every float as it is:
    infinities and NaN included, bit for bit)."""
    pack = _FLOAT8.pack
    elements = (_NULL if v is None else pack(8, v) for v in values)
    return _joined(Float8Array, values, elements)  # type: ignore[return-value]


def byteas(values: Sequence[bytes | None]) -> ByteaArray:
    """``values`` as a ``BYTEA[]``, None a null (the elements joined once: a generator
    of them cost a group's writer ~20 µs, bench/README.md)."""
    n = len(values)
    if not n:
        return _empty(ByteaArray)  # type: ignore[return-value]
    pack = _LENGTH.pack
    parts = [b""]
    nulls = 0
    for v in values:
        if v is None:
            parts.append(_NULL)
            nulls = 1
        else:
            parts.append(pack(len(v)))
            parts.append(v)
    parts[0] = _HEAD.pack(1, nulls, ByteaArray.element_oid) + _DIMENSION.pack(n, 1)
    return ByteaArray(b"".join(parts))


class _ArrayDumper(Dumper):
    """Passes a :class:`PgArray` on as it is, in binary, typed as its array type."""

    format = Format.BINARY

    def dump(self, obj: Buffer) -> Buffer:
        return obj


def _register() -> None:
    """Every psycopg connection made from now on dumps the arrays above (the global
    adapters are copied into each new connection)."""
    types = psycopg.adapters.types
    arrays = (
        (Int8Array, "int8"),
        (Int4Array, "int4"),
        (Int2Array, "int2"),
        (Float8Array, "float8"),
        (ByteaArray, "bytea"),
    )
    for cls, name in arrays:
        info = types[name]
        assert info.oid == cls.element_oid
        dumper = type(f"{cls.__name__}Dumper", (_ArrayDumper,), {"oid": info.array_oid})
        psycopg.adapters.register_dumper(cls, dumper)


_register()
