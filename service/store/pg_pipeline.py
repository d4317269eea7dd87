"""A transaction's statements in one pipeline, sent through libpq by the writer.

psycopg's pipeline (``Connection.pipeline()``) runs each statement through its cursor
machinery and talks to the server after each one — it sends what is queued and tries
to read — so a pipeline of ``BEGIN``, ``SELECT 1`` and ``COMMIT`` costs ~130 µs of the
writer's CPU on this machine against ~20 for the same messages sent through libpq
(``psycopg.pq``) with one flush and read back once (bench/README.md, Scale). The
ingest group's transaction is four statements, each group, all of it holding the GIL
that the event loop needs.

:func:`run` sends ``BEGIN``, the statements and ``COMMIT`` (or leaves the transaction
open, for a finalisation's reads and writes) through the connection's libpq object in
pipeline mode, with one Sync and one flush, waits for the results
with the GIL let go (``select``), and reads each statement's rows through psycopg's
own adaptation (:class:`psycopg.adapt.Transformer`): the parameters are dumped and
the rows loaded exactly as psycopg's ``execute`` would. An error comes up as psycopg
raises it (``psycopg.errors``), the transaction rolled back if :func:`run` began it and
left failed for its owner if it joined one (a group's batch rolls back to its own
savepoint); a lost connection comes up as its ``OperationalError``, and the caller
drops the connection.

The statements stay prepared on their connection for as long as it lives, so nothing
else may deallocate them: psycopg's own preparing is off on the store's connections
(``prepare_threshold=None``, :func:`~.engine.make_engine`), as it sends ``DEALLOCATE
ALL`` after any ``ROLLBACK`` (a savepoint's included) once it has prepared a
statement of its own. Should a name be gone all the same, the failing run forgets the
connection's names and the next one prepares them again.
The statements use psycopg's named placeholders (``%(name)s``, ``%(name)b``), converted
once (:class:`Query`).
"""

from __future__ import annotations

import itertools
import re
import select
import weakref
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import psycopg
import psycopg.abc
from psycopg import pq
from psycopg.adapt import PyFormat, Transformer

_PLACEHOLDER = re.compile(r"%\((\w+)\)([sb])|%%")
_FORMATS = {"s": PyFormat.AUTO, "b": PyFormat.BINARY}
_STARTED = (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR)
_DONE = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)
_Key = tuple[bytes, tuple[int, ...]]
_NO_SUCH_STATEMENT = b"26000"  # invalid_sql_statement_name: a prepared name is gone


@dataclass(frozen=True)
class Query:
    """A statement with named placeholders, as libpq takes it: ``$1``, ``$2``… and
    the name and format of each."""

    text: bytes
    names: tuple[str, ...]
    formats: tuple[PyFormat, ...]

    @classmethod
    def of(cls, sql: str) -> Query:
        order: dict[str, int] = {}
        formats: dict[str, PyFormat] = {}

        def placeholder(m: re.Match[str]) -> str:
            if m[0] == "%%":
                return "%"
            name, kind = m[1], _FORMATS[m[2]]
            if formats.setdefault(name, kind) != kind:
                raise ValueError(f"placeholder {name!r} with two formats")
            return f"${order.setdefault(name, len(order) + 1)}"

        text = _PLACEHOLDER.sub(placeholder, sql)
        names = tuple(order)
        return cls(text.encode(), names, tuple(formats[n] for n in names))


@cache
def query(sql: str) -> Query:
    """:meth:`Query.of`, once per statement text."""
    return Query.of(sql)


#: each connection's statements prepared here, by text and parameter types (psycopg
#: dumps an ``int`` as int2, int4 or int8 by its size, so one text may need several)
_PREPARED: weakref.WeakKeyDictionary[psycopg.Connection[Any], dict[_Key, bytes]] = (
    weakref.WeakKeyDictionary()
)
_names = itertools.count()


def run(
    driver: psycopg.Connection[Any],
    statements: Sequence[tuple[str, Mapping[str, Any]]],
    commit: bool = True,
    binary: bool = False,
    plan_each: Collection[str] = (),
    implicit: bool = False,
) -> list[list[tuple[Any, ...]]]:
    """Run ``statements`` (each a text and its parameters) as one transaction, in ONE
    round trip: :func:`begin` (unless ``driver`` is in a transaction already, which they
    join), the statements, ``COMMIT`` (unless ``commit`` is False: the transaction is
    left open, as psycopg's ``execute`` leaves it), one Sync. Returns each statement's
    rows (as tuples; ``binary``: read in the binary format, a ``bytea`` as its bytes
    rather than hex text). On an error, the transaction is rolled back and the error
    raised.

    Each statement is prepared on the connection the first time (in the same
    pipeline): the server then plans it once, as psycopg's own preparing does. Those
    of ``plan_each`` are sent unprepared, planned for their parameters each time (a
    plan made once for any array may read every step of a run).

    ``implicit`` (with ``commit``, and ``driver`` in no transaction, with no isolation
    level of its own): no ``BEGIN`` and no ``COMMIT`` are sent; the statements before
    the Sync are one implicit transaction, which the server commits at the Sync (its
    answer comes once the commit is durable) or, at an error, rolls back there: two
    statements fewer for the server to run, and no ``ROLLBACK`` to send after an
    error."""
    pgconn = driver.pgconn
    joined = pgconn.transaction_status in _STARTED
    implicit = implicit and commit and not joined and driver.isolation_level is None
    prepared = _PREPARED.setdefault(driver, {})
    tx = Transformer(driver)
    result_format = pq.Format.BINARY if binary else pq.Format.TEXT
    pgconn.enter_pipeline_mode()
    synced = read = False
    kept: list[bool] = []  # for each result to come: a statement's rows or not
    new: dict[_Key, bytes] = {}
    try:
        if not joined and not implicit and (commit or not driver.autocommit):
            pgconn.send_query_params(begin(driver), None)
            kept.append(False)
        for sql, params in statements:
            _send(pgconn, tx, sql, params, result_format, kept, prepared, new, sql in plan_each)
        if commit and not implicit:
            pgconn.send_query_params(b"COMMIT", None)
            kept.append(False)
        pgconn.pipeline_sync()
        synced = True
        _flush(pgconn)
        results = _results(pgconn)
        read = True
        pgconn.exit_pipeline_mode()
    except BaseException:
        _recover(driver, synced, read, joined)
        raise
    if any(r.status not in _DONE for r in results):
        _recover(driver, True, True, joined)
    rows = _rows(driver, tx, results, kept)
    prepared.update(new)
    return rows


def _send(
    pgconn: pq.abc.PGconn,
    tx: psycopg.abc.Transformer,
    sql: str,
    params: Mapping[str, Any],
    result_format: pq.Format,
    kept: list[bool],
    prepared: Mapping[_Key, bytes],
    new: dict[_Key, bytes],
    unprepared: bool = False,
) -> None:
    """Queue one statement on ``pgconn`` (in pipeline mode): prepared under a name of
    ``prepared`` or ``new`` (a new one added to ``new`` and its ``Parse`` sent first),
    or (``unprepared``) planned for its parameters; ``kept`` gains whether each result
    to come is the statement's rows."""
    if unprepared:
        q = query(sql)
        values = tx.dump_sequence([params[n] for n in q.names], q.formats)
        types, formats = tuple(tx.types or ()), [f.value for f in tx.formats or ()]
        pgconn.send_query_params(q.text, values, types, formats, result_format)
        kept.append(True)
        return
    name, values, formats = _named(pgconn, tx, sql, params, kept, prepared, new)
    pgconn.send_query_prepared(name, values, formats, result_format)
    kept.append(True)


_Named = tuple[bytes, Sequence[psycopg.abc.Buffer | None], list[int]]


def _named(
    pgconn: pq.abc.PGconn,
    tx: psycopg.abc.Transformer,
    sql: str,
    params: Mapping[str, Any],
    kept: list[bool],
    prepared: Mapping[_Key, bytes],
    new: dict[_Key, bytes],
) -> _Named:
    """A statement's prepared name (its ``Parse`` queued on ``pgconn`` if it is new, a
    new name added to ``new`` and ``kept`` told of its result) and its parameters,
    dumped, and their formats."""
    q = query(sql)
    values = tx.dump_sequence([params[n] for n in q.names], q.formats)
    types, formats = tuple(tx.types or ()), [f.value for f in tx.formats or ()]
    key = (q.text, types)
    name = prepared.get(key) or new.get(key)
    if name is None:
        name = new[key] = f"steptally_{next(_names)}".encode()
        pgconn.send_prepare(name, q.text, types)
        kept.append(False)
    return name, values, formats


def _rows(
    driver: psycopg.Connection[Any],
    tx: psycopg.abc.Transformer,
    results: Sequence[pq.abc.PGresult],
    kept: Sequence[bool],
) -> list[list[tuple[Any, ...]]]:
    """Each statement's rows from its transaction's ``results``; the first error
    raised as psycopg raises it (a prepared name gone: the connection's names
    forgotten, to be prepared anew)."""
    error = next((r for r in results if r.status not in _DONE), None)
    if error is not None:
        if error.error_field(pq.DiagnosticField.SQLSTATE) == _NO_SUCH_STATEMENT:
            _PREPARED.pop(driver, None)  # deallocated behind our back: prepare anew
        raise psycopg.errors.error_from_result(error, encoding=tx.encoding)
    rows = []
    for result, keep in zip(results, kept, strict=True):
        if keep:
            tx.set_pgresult(result)
            rows.append(tx.load_rows(0, result.ntuples, tuple) if result.ntuples else [])
    return rows


def begin(driver: psycopg.Connection[Any]) -> bytes:
    """The ``BEGIN`` psycopg would send: this connection's isolation level, if set."""
    if driver.isolation_level is None:
        return b"BEGIN"
    level = psycopg.IsolationLevel(driver.isolation_level).name.replace("_", " ")
    return f"BEGIN ISOLATION LEVEL {level}".encode()


def _flush(pgconn: pq.abc.PGconn) -> None:
    while pgconn.flush():  # 1: more to send, and the socket is full
        select.select([pgconn.socket], [pgconn.socket], [])
        pgconn.consume_input()  # the server may be waiting for us to read


def _results(pgconn: pq.abc.PGconn) -> list[pq.abc.PGresult]:
    """Every statement's result, up to the Sync's (a statement that produced none —
    skipped after an error — has its ``PIPELINE_ABORTED``)."""
    out: list[pq.abc.PGresult] = []
    while True:
        while pgconn.is_busy():
            select.select([pgconn.socket], [], [])
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:  # the end of one statement's results
            if pgconn.status != pq.ConnStatus.OK:
                raise psycopg.OperationalError(pgconn.get_error_message())
            continue
        if result.status == pq.ExecStatus.PIPELINE_SYNC:
            return out
        out.append(result)


def _recover(driver: psycopg.Connection[Any], synced: bool, read: bool, joined: bool) -> None:
    """After an error: read the pipeline through its Sync (sent here if it was not),
    leave pipeline mode and roll back the transaction :func:`run` began, if the
    connection is still there (else its error is on its way up). A transaction it
    joined is left failed, for its owner to roll back, to a savepoint of its own or
    whole: rolling it back here would undo what a group's earlier batches stored
    (acknowledged once the group commits), and the owner's savepoint with it."""
    pgconn = driver.pgconn
    if pgconn.status != pq.ConnStatus.OK:
        return
    try:
        if pgconn.pipeline_status != pq.PipelineStatus.OFF:
            if not synced:
                pgconn.pipeline_sync()
            if not read:
                _flush(pgconn)
                _results(pgconn)
            pgconn.exit_pipeline_mode()
        if not joined and pgconn.transaction_status in _STARTED:
            driver.rollback()
    except psycopg.Error:  # the connection broke on the way: the caller drops it
        return


@dataclass
class Sent:
    """A transaction sent by :func:`send`, its results still to come: for each result,
    whether it is a statement's rows."""

    kept: list[bool]
    tx: psycopg.abc.Transformer
    driver: psycopg.Connection[Any]


def send(
    driver: psycopg.Connection[Any], statements: Sequence[tuple[str, Mapping[str, Any]]]
) -> Sent:
    """Send ``statements`` as ONE implicit transaction (no ``BEGIN``: the server commits
    what runs before the Sync, or rolls all of it back at the first error) and do not
    wait: the connection is put in pipeline mode (if it is not there already, with
    transactions sent before still to answer). Its results come, in the order the
    transactions were sent, to whoever reads the connection; :func:`rows_of` makes
    them rows. The caller keeps every other use of the connection out until it has
    read every answer and left pipeline mode (:func:`leave`).

    Each statement is prepared the first time, as in :func:`run`; its name counts as
    known from then on, so that a transaction sent behind it uses it whether or not
    the first one commits (a prepared statement outlives its transaction). So every
    ``Parse`` goes before the first statement runs: after a failed statement the
    server skips the rest of the transaction, a ``Parse`` behind it too, and its name
    would be taken as prepared when it is not."""
    pgconn = driver.pgconn
    prepared = _PREPARED.setdefault(driver, {})
    tx = Transformer(driver)
    if pgconn.pipeline_status == pq.PipelineStatus.OFF:
        pgconn.enter_pipeline_mode()
    kept: list[bool] = []
    named = [
        _named(pgconn, tx, sql, params, kept, prepared, prepared) for sql, params in statements
    ]
    for name, values, formats in named:  # after every Parse: a failed one skips what follows
        pgconn.send_query_prepared(name, values, formats, pq.Format.TEXT)
        kept.append(True)
    pgconn.pipeline_sync()
    _flush(pgconn)
    return Sent(kept, tx, driver)


def rows_of(sent: Sent, results: Sequence[pq.abc.PGresult]) -> list[list[tuple[Any, ...]]]:
    """The rows of each statement of ``sent``, from its results up to its Sync; its
    error, raised as psycopg raises it, where it failed (then the server rolled its
    transaction back)."""
    return _rows(sent.driver, sent.tx, results, sent.kept)


def leave(driver: psycopg.Connection[Any]) -> None:
    """Take the connection out of pipeline mode, every transaction sent answered."""
    if driver.pgconn.pipeline_status != pq.PipelineStatus.OFF:
        driver.pgconn.exit_pipeline_mode()
