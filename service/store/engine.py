"""Engines and transactions for SQLite (embedded default) and PostgreSQL.

SQLite runs in WAL mode with ``synchronous=FULL`` (an acknowledged write survives a
power cut) and a busy timeout; a write transaction starts with ``BEGIN IMMEDIATE``,
so writers queue for the database lock instead of failing half-way, and readers use
a plain deferred ``BEGIN``. PostgreSQL runs at READ COMMITTED and the store locks the
rows it changes (``SELECT … FOR UPDATE`` or an upsert).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event

_WRITE = "steptally_write"
BUSY_TIMEOUT_MS = 30_000


def make_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite gets its pragmas and explicit transactions."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False})
        event.listen(engine, "connect", _sqlite_connect)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    return create_engine(url, pool_size=10, max_overflow=20, pool_pre_ping=True)


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # SQLAlchemy's "begin" event issues BEGIN
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA journal_mode = WAL")
    cursor.execute("PRAGMA synchronous = FULL")
    cursor.execute("PRAGMA foreign_keys = ON")
    cursor.close()


def _sqlite_begin(conn: Connection) -> None:
    immediate = conn.get_execution_options().get(_WRITE, False)
    conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


@contextmanager
def transaction(engine: Engine, write: bool) -> Iterator[Connection]:
    """One transaction, committed when the block ends without an exception."""
    with engine.connect() as conn:
        if write:
            conn.execution_options(**{_WRITE: True})
        with conn.begin():
            yield conn


def is_postgres(engine: Engine | Connection) -> bool:
    return engine.dialect.name == "postgresql"
