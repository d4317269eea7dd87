"""Engines and transactions for SQLite (embedded default) and PostgreSQL.

SQLite runs in WAL mode with ``synchronous=FULL`` (an acknowledged write survives a
power cut) and a busy timeout; a write transaction starts with ``BEGIN IMMEDIATE``,
so writers queue for the database lock instead of failing half-way, and readers use
a plain deferred ``BEGIN``. PostgreSQL runs at READ COMMITTED and the store locks the
rows it changes (``SELECT … FOR UPDATE`` or an upsert).

:class:`DatabaseLimits` bound every wait on the database: connecting, taking a pooled
connection, and (PostgreSQL) each statement, a wait for a lock included. A database
that hangs so turns into errors (503 ``unavailable`` at the API), never a hung request.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url

_WRITE = "steptally_write"


@dataclass(frozen=True, slots=True)
class DatabaseLimits:
    """How long any one wait on the database may last, in seconds."""

    statement_timeout_s: float = 30.0  # PostgreSQL's statement_timeout, SQLite's busy timeout
    pool_timeout_s: float = 10.0  # for a connection of the pool
    connect_timeout_s: float = 5.0  # for a new connection (PostgreSQL: whole seconds)


def make_engine(url: str, limits: DatabaseLimits | None = None) -> Engine:
    """An engine for ``url``; SQLite gets its pragmas and explicit transactions."""
    limits = limits or DatabaseLimits()
    if make_url(url).get_backend_name() == "sqlite":
        engine = create_engine(
            url, connect_args={"check_same_thread": False}, pool_timeout=limits.pool_timeout_s
        )
        busy_ms = max(1, round(limits.statement_timeout_s * 1000))
        event.listen(engine, "connect", functools.partial(_sqlite_connect, busy_ms))
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    statement_ms = max(1, round(limits.statement_timeout_s * 1000))
    connect_args = {
        "connect_timeout": max(1, round(limits.connect_timeout_s)),
        "options": f"-c statement_timeout={statement_ms}",
        # the ingest path prepares its own statements (pg_pipeline); psycopg's preparing
        # would deallocate them all at the first rollback after it prepared one of its own
        "prepare_threshold": None,
    }
    return create_engine(
        url,
        pool_size=10,
        max_overflow=20,
        pool_pre_ping=True,
        pool_timeout=limits.pool_timeout_s,
        connect_args=connect_args,
    )


def _sqlite_connect(busy_ms: int, dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # SQLAlchemy's "begin" event issues BEGIN
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout = {busy_ms}")
    cursor.execute("PRAGMA journal_mode = WAL")
    cursor.execute("PRAGMA synchronous = FULL")
    cursor.execute("PRAGMA foreign_keys = ON")
    cursor.close()


def _sqlite_begin(conn: Connection) -> None:
    immediate = conn.get_execution_options().get(_WRITE, False)
    conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def writing(conn: Connection) -> Connection:
    """``conn``, its transactions from now on write transactions (SQLite: ``BEGIN
    IMMEDIATE``)."""
    return conn.execution_options(**{_WRITE: True})


@contextmanager
def transaction(engine: Engine, write: bool) -> Iterator[Connection]:
    """One transaction, committed when the block ends without an exception."""
    with engine.connect() as conn:
        if write:
            writing(conn)
        with conn.begin():
            yield conn
