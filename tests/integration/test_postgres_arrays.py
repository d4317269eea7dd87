"""The ingest path's arrays, encoded by :mod:`steptally.service.store.pg_arrays`, read
back by real PostgreSQL exactly as psycopg's own list dumper sends them."""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from steptally.service.store.pg_arrays import byteas, float8s, int2s, int4s, int8s

pytestmark = pytest.mark.postgres


@pytest.fixture
def conn(pg_admin_url: str) -> Iterator[psycopg.Connection]:
    url = pg_admin_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url) as c:
        yield c


CASES: list[tuple[Any, str, list[Any]]] = [
    (int8s, "BIGINT", []),
    (int8s, "BIGINT", [0]),
    (int8s, "BIGINT", [-(2**63), 2**63 - 1, 1, -1, 2**40 + 7]),
    (int4s, "INTEGER", [-(2**31), 2**31 - 1, 0, 255]),
    (int4s, "INTEGER", []),
    (int2s, "SMALLINT", [-(2**15), 2**15 - 1, 0, 2]),
    (float8s, "DOUBLE PRECISION", []),
    (
        float8s,
        "DOUBLE PRECISION",
        [0.1, -0.0, None, math.inf, -math.inf, 5e-324, 1.7976931348623157e308],
    ),
    (byteas, "BYTEA", []),
    (byteas, "BYTEA", [b"", b"\x00\xff" * 1000, None, b"x"]),
    (byteas, "BYTEA", [None, None]),
    (byteas, "BYTEA", [bytes(range(256))]),
]


@pytest.mark.parametrize(("encode", "kind", "values"), CASES)
def test_an_array_reads_back_as_the_list_it_was_made_of(
    conn: psycopg.Connection, encode: Any, kind: str, values: list[Any]
) -> None:
    ours = conn.execute(f"SELECT %b::{kind}[]", [encode(values)]).fetchone()
    theirs = conn.execute(f"SELECT %b::{kind}[]", [values]).fetchone()
    assert ours == theirs == (values,)
    if encode is float8s:  # bit for bit: -0.0 stays negative
        assert [math.copysign(1, v) for v in ours[0] if v is not None] == [
            math.copysign(1, v) for v in values if v is not None
        ]


def test_nan_goes_through_as_nan(conn: psycopg.Connection) -> None:
    (got,) = conn.execute("SELECT %b::DOUBLE PRECISION[]", [float8s([math.nan])]).fetchone()
    assert len(got) == 1 and math.isnan(got[0])


def test_arrays_unnest_side_by_side_as_the_statements_use_them(conn: psycopg.Connection) -> None:
    rows = conn.execute(
        "SELECT * FROM unnest(%(s)b::BIGINT[], %(r)b::INTEGER[], %(v)b::BYTEA[]) AS t(s, r, v)",
        {"s": int8s([3, 3, 7]), "r": int4s([5, 6, 255]), "v": byteas([b"a", None, b"bc"])},
    ).fetchall()
    assert rows == [(3, 5, b"a"), (3, 6, None), (7, 255, b"bc")]


def test_an_array_of_another_type_is_converted_or_refused_never_misread(
    conn: psycopg.Connection,
) -> None:
    # typed as what it is: the statement's cast converts it, checking each value
    assert conn.execute("SELECT %b::INTEGER[]", [int8s([1, -2])]).fetchone() == ([1, -2],)
    with pytest.raises(psycopg.errors.NumericValueOutOfRange):
        conn.execute("SELECT %b::INTEGER[]", [int8s([2**31])])


def test_a_value_out_of_the_type_s_range_is_refused_before_it_is_sent() -> None:
    with pytest.raises((struct.error, OverflowError)):
        int4s([2**31])
    with pytest.raises((struct.error, OverflowError)):
        int8s([-(2**63) - 1])
