"""A whole transaction in one round trip (:func:`.sql_postgres.whole_transaction`),
against real PostgreSQL, its messages read from libpq's own trace.

psycopg, left to begin a transaction inside a pipeline, sends its ``BEGIN`` with a Sync
of its own and waits for the answer before the statements go: one round trip more
for every fresh group a writer stores."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from psycopg import pq

from steptally.service.store.sql_postgres import whole_transaction

pytestmark = pytest.mark.postgres


@pytest.fixture
def url(pg_admin_url: str) -> str:
    return pg_admin_url.replace("postgresql+psycopg://", "postgresql://")


@pytest.fixture
def conn(url: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(url) as c:
        c.execute("DROP TABLE IF EXISTS round_trip_t")
        c.execute("CREATE TABLE round_trip_t (k INTEGER PRIMARY KEY)")
        c.commit()
        yield c
        c.rollback()
        c.execute("DROP TABLE round_trip_t")
        c.commit()


def _stored(url: str) -> list[int]:
    """What another connection sees committed."""
    with psycopg.connect(url) as other:
        return [k for (k,) in other.execute("SELECT k FROM round_trip_t ORDER BY k")]


@contextmanager
def _traced(conn: psycopg.Connection, path: Path) -> Iterator[None]:
    """libpq's trace of the messages ``conn`` sends and receives in the block, to ``path``."""
    with path.open("w") as f:
        conn.pgconn.trace(f.fileno())
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            yield
        finally:
            conn.pgconn.untrace()


def _syncs(path: Path) -> int:
    """How many Sync messages the client sent: each is a wait for the server's answer."""
    return len(re.findall(r"^F\t\d+\tSync$", path.read_text(), re.MULTILINE))


def test_begin_statements_and_commit_go_with_one_sync(
    conn: psycopg.Connection, url: str, tmp_path: Path
) -> None:
    trace = tmp_path / "trace"
    with _traced(conn, trace), whole_transaction(conn):
        conn.execute("INSERT INTO round_trip_t VALUES (1)")
        conn.execute("INSERT INTO round_trip_t VALUES (2)")
    assert _syncs(trace) == 1
    text = trace.read_text()
    assert text.index("BEGIN") < text.index("INSERT") < text.index("COMMIT")
    assert _stored(url) == [1, 2]
    assert conn.pgconn.transaction_status == pq.TransactionStatus.IDLE
    assert conn.autocommit is False


def test_psycopg_alone_takes_a_round_trip_more(
    conn: psycopg.Connection, url: str, tmp_path: Path
) -> None:
    """What the helper saves: the same statements in psycopg's own transaction."""
    trace = tmp_path / "trace"
    with _traced(conn, trace), conn.pipeline():
        conn.execute("INSERT INTO round_trip_t VALUES (1)")
        conn.execute(b"COMMIT")
    assert _syncs(trace) == 2
    assert _stored(url) == [1]


def test_a_failed_statement_rolls_the_whole_block_back(conn: psycopg.Connection, url: str) -> None:
    with pytest.raises(psycopg.errors.UniqueViolation), whole_transaction(conn):
        conn.execute("INSERT INTO round_trip_t VALUES (1)")
        conn.execute("INSERT INTO round_trip_t VALUES (1)")
    assert _stored(url) == []
    assert conn.pgconn.transaction_status == pq.TransactionStatus.IDLE
    assert conn.autocommit is False
    conn.execute("INSERT INTO round_trip_t VALUES (3)")  # the connection goes on as before
    conn.commit()
    assert _stored(url) == [3]


def test_a_block_inside_a_transaction_commits_what_came_before(
    conn: psycopg.Connection, url: str
) -> None:
    conn.execute("INSERT INTO round_trip_t VALUES (1)")
    with whole_transaction(conn):
        conn.execute("INSERT INTO round_trip_t VALUES (2)")
    assert _stored(url) == [1, 2]
    assert conn.autocommit is False


def test_the_connections_isolation_level_is_kept(conn: psycopg.Connection) -> None:
    conn.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
    with whole_transaction(conn):
        level = conn.execute("SHOW transaction_isolation")
    assert level.fetchone() == ("serializable",)
