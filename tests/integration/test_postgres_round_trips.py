"""PostgreSQL's hot statements in one round trip each, against real PostgreSQL, the
messages read from libpq's own trace: a transaction sent through libpq
(:func:`.pg_pipeline.run`), a finalisation's lock and read of its steps' parts, and
its write of the step rows and values.

psycopg, left to begin a transaction inside a pipeline, sends its ``BEGIN`` with a Sync
of its own and waits for the answer before the statements go: one round trip more
for every fresh group a writer stored that way."""

from __future__ import annotations

import math
import random
import re
import select
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from psycopg import pq

from steptally.service.domain.progress import StepStatus
from steptally.service.domain.step import StepState
from steptally.service.store import pg_pipeline, sql_run
from steptally.service.store.engine import make_engine
from steptally.service.store.sql_postgres import PostgresDialect
from steptally.service.store.sql_step import read_parts

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
    with psycopg.connect(url, autocommit=True) as after:  # the test's may be lost
        after.execute("DROP TABLE round_trip_t")


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


@pytest.fixture
def run_conn(postgres_url: str) -> Iterator[tuple[sa.Connection, psycopg.Connection]]:
    """A store's connection (and its driver's) over an emptied database holding run 1."""
    from tests.integration.conftest import _empty

    _empty(postgres_url)
    engine = make_engine(postgres_url)
    try:
        with engine.connect() as conn:
            driver = conn.connection.driver_connection
            assert isinstance(driver, psycopg.Connection)
            driver.execute(
                "INSERT INTO runs (id, name, world_size, spec, step_timeout_s, created_at) "
                "VALUES (1, 'r', 64, '{}', 60, 0)"
            )
            driver.commit()
            yield conn, driver
    finally:
        engine.dispose()


def _open_step(driver: psycopg.Connection, step: int, *counters: float) -> None:
    """An open step of run 1: ``counters`` are its committed ranks, expected and
    received fragments, missing ranks, first-seen time and deadline."""
    driver.execute(
        "INSERT INTO steps (run_id, step, status, revision, committed_ranks, "
        "expected, received, missing_ranks, first_seen_at, deadline) "
        "VALUES (1, %s, 'open', 0, %s, %s, %s, %s, %s, %s)",
        (step, *counters),
    )


def test_psycopg_alone_takes_a_round_trip_more(
    conn: psycopg.Connection, url: str, tmp_path: Path
) -> None:
    """What :func:`.pg_pipeline.run` saves: the statements in psycopg's own transaction."""
    trace = tmp_path / "trace"
    with _traced(conn, trace), conn.pipeline():
        conn.execute("INSERT INTO round_trip_t VALUES (1)")
        conn.execute(b"COMMIT")
    assert _syncs(trace) == 2
    assert _stored(url) == [1]


def test_a_steps_parts_come_in_one_round_trip_bit_for_bit(
    run_conn: tuple[sa.Connection, psycopg.Connection], tmp_path: Path
) -> None:
    """The finalisation's read of a step's partial rows and commits: the same rows as
    the statements through SQLAlchemy, each state byte for byte, in one round trip."""
    conn, driver = run_conn
    rnd = random.Random(5)
    states = {rank: rnd.randbytes(rnd.choice([0, 1, 1600, 9000])) for rank in range(40)}
    for step in (3, 4):
        for rank, state in states.items():
            driver.execute(
                "INSERT INTO partials VALUES (1, %s, %s, %s, %s)",
                (step, rank, rank + step, state),
            )
            driver.execute("INSERT INTO commits VALUES (1, %s, %s, %s)", (step, rank, rank * 2))
    driver.commit()
    driver.execute("SELECT 1")  # inside a transaction, as a finalisation reads
    trace = tmp_path / "trace"
    with _traced(driver, trace):
        parts, commits = PostgresDialect().read_parts(conn, 1, 4)
    theirs = read_parts(conn, 1, 4)
    assert _syncs(trace) == 1
    assert sorted(parts) == sorted(theirs[0]) == [(r, r + 4, s) for r, s in states.items()]
    assert all(type(state) is bytes for _, _, state in parts)
    assert sorted(commits) == sorted(theirs[1]) == [(r, r * 2) for r in states]


def test_a_finalisations_rows_and_values_go_in_one_round_trip(
    run_conn: tuple[sa.Connection, psycopg.Connection], tmp_path: Path
) -> None:
    """A finalisation's write of its step rows and their values: one round trip, every
    column as it was set, a value of each kind (-0.0 and infinities bit for bit, NaN,
    undefined), those of a first finalisation inserted and those of a later one
    replacing the step's earlier ones; a row left unchanged is not written."""
    rows = [
        StepState(3, StepStatus.COMPLETE, 1, 4, 32, 32, 0, 1.0, 61.0, 9.5, '{"r": 3}'),
        StepState(4, StepStatus.PARTIAL, 2, 3, 24, 24, 1, 2.0, 62.0, 9.75, '{"r": 4}'),
        StepState(5, StepStatus.OPEN, 0, 1, 8, 8, 3, 3.0, 63.0, None, None),
    ]
    rows[0].values = [(0, -0.0, 0), (1, math.inf, 0), (2, None, 2)]
    rows[1].values = [(0, 2.5, 0), (1, None, 1), (2, -math.inf, 0)]
    rows[0].changed = rows[1].changed = True
    conn, driver = run_conn
    for step in (3, 4, 5):
        _open_step(driver, step, 0, 0, 0, 4, 0, 60)
    driver.execute("INSERT INTO step_values VALUES (1, 0, 4, 7.0, 0)")  # revision 1's: replaced
    driver.commit()
    driver.execute("SELECT 1")  # inside a transaction, as a finalisation writes
    trace = tmp_path / "trace"
    with _traced(driver, trace):
        PostgresDialect().write_steps(conn, 1, rows)
    driver.commit()
    steps = driver.execute(
        "SELECT step, status, revision, committed_ranks, expected, received, "
        "missing_ranks, finalised_at, result FROM steps ORDER BY step"
    ).fetchall()
    values = driver.execute(
        "SELECT step, col, value, state FROM step_values ORDER BY step, col"
    ).fetchall()
    assert _syncs(trace) == 1
    # step 3's values (its first finalisation) by a plain insert, step 4's by an upsert
    parsed = re.findall(r'\tParse\t "[^"]*" "(INSERT INTO step_values[^"]*)"', trace.read_text())
    assert ["ON CONFLICT" in text for text in parsed] == [False, True], parsed
    assert steps == [
        (3, "complete", 1, 4, 32, 32, 0, 9.5, '{"r": 3}'),
        (4, "partial", 2, 3, 24, 24, 1, 9.75, '{"r": 4}'),
        (5, "open", 0, 0, 0, 0, 4, None, None),  # not changed: as it was
    ]
    assert values == [
        (3, 0, -0.0, 0), (3, 1, math.inf, 0), (3, 2, None, 2),
        (4, 0, 2.5, 0), (4, 1, None, 1), (4, 2, -math.inf, 0),
    ]  # fmt: skip
    assert math.copysign(1.0, values[0][2]) == -1.0


# ---------------------------------------------------------------- pg_pipeline.run

_INSERT = "INSERT INTO round_trip_t VALUES (%(k)b::INTEGER) RETURNING k, %(x)b::DOUBLE PRECISION"
_ROW = (
    "SELECT %(i)s::BIGINT, %(f)b::DOUBLE PRECISION, %(t)s::TEXT, %(b)b::BYTEA, "
    "%(n)s::INTEGER, %(i)s::BIGINT %% 7, %(a)b::BIGINT[], 'x%%y'"
)


def _parses(path: Path, table: str) -> int:
    """How many times the client asked the server to parse (and plan) a statement on
    ``table``."""
    return len(re.findall(rf"^F\t\d+\tParse\t.*{table}", path.read_text(), re.MULTILINE))


def test_a_pipeline_runs_begin_statements_and_commit_with_one_sync(
    conn: psycopg.Connection, url: str, tmp_path: Path
) -> None:
    trace = tmp_path / "trace"
    with _traced(conn, trace):
        rows = pg_pipeline.run(
            conn, [(_INSERT, {"k": 1, "x": -0.0}), (_INSERT, {"k": 2, "x": math.inf})]
        )
    assert _syncs(trace) == 1
    text = trace.read_text()
    assert text.index("BEGIN") < text.index("INSERT") < text.index("COMMIT")
    assert rows == [[(1, -0.0)], [(2, math.inf)]]
    assert math.copysign(1.0, rows[0][0][1]) == -1.0
    assert _stored(url) == [1, 2]
    assert conn.pgconn.transaction_status == pq.TransactionStatus.IDLE
    assert conn.pgconn.pipeline_status == pq.PipelineStatus.OFF
    conn.execute("SELECT 1")  # psycopg goes on using the connection


def test_an_implicit_pipeline_commits_at_its_sync_or_rolls_back_there(
    conn: psycopg.Connection, url: str, tmp_path: Path
) -> None:
    """No ``BEGIN``, no ``COMMIT``: the statements before the Sync are one transaction,
    committed when the answer comes; at an error nothing of it stays, and nothing more
    is sent to roll it back."""
    trace = tmp_path / "trace"
    with _traced(conn, trace):
        rows = pg_pipeline.run(
            conn, [(_INSERT, {"k": 1, "x": 0.5}), (_INSERT, {"k": 2, "x": 1.5})], implicit=True
        )
    assert rows == [[(1, 0.5)], [(2, 1.5)]]
    assert _stored(url) == [1, 2]
    failed = tmp_path / "failed"
    with _traced(conn, failed), pytest.raises(psycopg.errors.UniqueViolation):
        pg_pipeline.run(
            conn, [(_INSERT, {"k": 3, "x": 0.0}), (_INSERT, {"k": 1, "x": 0.0})], implicit=True
        )
    assert _stored(url) == [1, 2]  # k 3 rolled back with the rest
    for path in (trace, failed):
        text = path.read_text()
        assert _syncs(path) == 1
        assert not re.search(r"BEGIN|COMMIT|ROLLBACK", text), text
    assert conn.pgconn.transaction_status == pq.TransactionStatus.IDLE
    assert conn.pgconn.pipeline_status == pq.PipelineStatus.OFF
    conn.execute("SELECT 1")  # psycopg goes on using the connection


def _sent(conn: psycopg.Connection, statements: Any) -> list[list[tuple[Any, ...]]]:
    """:func:`.pg_pipeline.send`, then its answer read as the loop's writer reads it."""
    sent = pg_pipeline.send(conn, statements)
    results = []
    while (result := _next(conn)).status != pq.ExecStatus.PIPELINE_SYNC:
        results.append(result)
    pg_pipeline.leave(conn)
    return pg_pipeline.rows_of(sent, results)


def _next(conn: psycopg.Connection) -> Any:
    pgconn = conn.pgconn
    while True:
        while pgconn.is_busy():
            select.select([pgconn.socket], [], [])
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is not None:
            return result


def test_a_sent_transaction_prepares_every_statement_before_the_first_runs(
    conn: psycopg.Connection, url: str
) -> None:
    """A statement that fails makes the server skip the rest of its transaction: a
    statement prepared for the first time behind it would be skipped with its
    ``Parse``, and the next transaction would name a statement that does not exist."""
    conn.commit()
    first = "SELECT k FROM round_trip_t WHERE k = %(k)b::INTEGER"
    fails = "SELECT 1 / %(zero)b::INTEGER"
    later = "SELECT %(k)b::INTEGER + 1"
    with pytest.raises(psycopg.errors.DivisionByZero):
        _sent(conn, [(first, {"k": 1}), (fails, {"zero": 0}), (later, {"k": 1})])
    assert _sent(conn, [(first, {"k": 1}), (later, {"k": 1})]) == [[], [(2,)]]
    assert _stored(url) == []


def test_a_pipelines_rows_load_as_psycopg_loads_them(conn: psycopg.Connection) -> None:
    params = {
        "i": 2**40 + 3, "f": 1 / 3, "t": "é", "b": b"\x00\xff", "n": None, "a": [1, -2],
    }  # fmt: skip
    [mine] = pg_pipeline.run(conn, [(_ROW, params)])
    theirs = conn.execute(_ROW, params).fetchall()
    conn.rollback()
    assert (
        mine
        == theirs
        == [(2**40 + 3, 1 / 3, "é", b"\x00\xff", None, (2**40 + 3) % 7, [1, -2], "x%y")]
    )


def test_a_statement_is_parsed_once_a_connection_and_parameter_types(
    conn: psycopg.Connection, tmp_path: Path
) -> None:
    """The server plans each statement once; a parameter that psycopg dumps as another
    type (an int too large for int2) is another preparation, and both answer right."""
    trace = tmp_path / "trace"
    with _traced(conn, trace):
        for k in (1, 2, 3):
            pg_pipeline.run(conn, [(_INSERT, {"k": k, "x": 0.5})])
        assert pg_pipeline.run(conn, [(_INSERT, {"k": 70000, "x": 0.5})]) == [[(70000, 0.5)]]
        assert pg_pipeline.run(conn, [(_INSERT, {"k": 4, "x": 0.5})]) == [[(4, 0.5)]]
    assert _parses(trace, "round_trip_t") == 2


def test_a_failed_statement_rolls_the_pipeline_back(conn: psycopg.Connection, url: str) -> None:
    """Nothing of the pipeline stays, the connection goes on, and a statement first
    prepared in the failed pipeline is prepared again and runs."""
    fresh = "INSERT INTO round_trip_t SELECT %(k)b::INTEGER + 0"
    with pytest.raises(psycopg.errors.UniqueViolation):
        pg_pipeline.run(conn, [(_INSERT, {"k": 1, "x": 0.0}), (_INSERT, {"k": 1, "x": 0.0})])
    with pytest.raises(psycopg.errors.UniqueViolation):
        pg_pipeline.run(conn, [(_INSERT, {"k": 5, "x": 0.0}), (fresh, {"k": 5})])
    assert _stored(url) == []
    assert conn.pgconn.transaction_status == pq.TransactionStatus.IDLE
    assert conn.pgconn.pipeline_status == pq.PipelineStatus.OFF
    pg_pipeline.run(conn, [(fresh, {"k": 6})])
    conn.execute("INSERT INTO round_trip_t VALUES (7)")
    conn.commit()
    assert _stored(url) == [6, 7]


def test_a_failed_pipeline_in_a_joined_transaction_leaves_it_to_its_owner(
    conn: psycopg.Connection, url: str
) -> None:
    """What the owner stored before stays: the transaction is left failed, not rolled
    back, and the owner's rollback to its savepoint keeps the rest, which it commits."""
    conn.execute("INSERT INTO round_trip_t VALUES (1)")  # a group's earlier batch
    conn.execute("SAVEPOINT batch")
    with pytest.raises(psycopg.errors.UniqueViolation):
        pg_pipeline.run(conn, [(_INSERT, {"k": 2, "x": 0.0}), (_INSERT, {"k": 1, "x": 0.0})])
    assert conn.pgconn.transaction_status == pq.TransactionStatus.INERROR
    assert conn.pgconn.pipeline_status == pq.PipelineStatus.OFF
    conn.execute("ROLLBACK TO SAVEPOINT batch")
    pg_pipeline.run(conn, [(_INSERT, {"k": 3, "x": 0.0})])  # commits what came before
    assert _stored(url) == [1, 3]


def test_a_statement_deallocated_behind_its_back_is_prepared_again(
    conn: psycopg.Connection, url: str
) -> None:
    """A name gone (``DEALLOCATE ALL`` from elsewhere on the connection) fails the
    pipeline that used it, once: the next one prepares its statements anew."""
    pg_pipeline.run(conn, [(_INSERT, {"k": 1, "x": 0.0})])
    conn.execute("DEALLOCATE ALL")
    conn.commit()
    with pytest.raises(psycopg.errors.InvalidSqlStatementName):
        pg_pipeline.run(conn, [(_INSERT, {"k": 2, "x": 0.0})])
    assert conn.pgconn.transaction_status == pq.TransactionStatus.IDLE
    [[row]] = pg_pipeline.run(conn, [(_INSERT, {"k": 2, "x": 0.5})])
    assert row == (2, 0.5)
    assert _stored(url) == [1, 2]


def test_a_pipeline_on_a_lost_connection_raises_its_error(
    conn: psycopg.Connection, url: str
) -> None:
    pg_pipeline.run(conn, [(_INSERT, {"k": 1, "x": 0.0})])
    with psycopg.connect(url, autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
    with pytest.raises(psycopg.OperationalError):
        pg_pipeline.run(conn, [(_INSERT, {"k": 2, "x": 0.0})])
    assert conn.broken
    assert _stored(url) == [1]


def test_a_pipeline_inside_a_transaction_commits_what_came_before(
    conn: psycopg.Connection, url: str, tmp_path: Path
) -> None:
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    conn.execute("INSERT INTO round_trip_t VALUES (1)")
    trace = tmp_path / "trace"
    with _traced(conn, trace):
        pg_pipeline.run(conn, [(_INSERT, {"k": 2, "x": 0.0})])
    assert _syncs(trace) == 1
    assert "BEGIN" not in trace.read_text()
    assert _stored(url) == [1, 2]
    [[level]] = pg_pipeline.run(conn, [("SHOW transaction_isolation", {})])
    assert level == ("repeatable read",)


def test_named_placeholders_become_numbered_ones() -> None:
    q = pg_pipeline.Query.of("SELECT %(a)s, %(b)b, %(a)s, '%%'")
    assert q.text == b"SELECT $1, $2, $1, '%'"
    assert q.names == ("a", "b")
    with pytest.raises(ValueError, match="two formats"):
        pg_pipeline.Query.of("SELECT %(a)s, %(a)b")


def test_a_pipeline_can_leave_its_transaction_open(conn: psycopg.Connection, url: str) -> None:
    """A finalisation's reads and writes: the statements in the caller's transaction,
    which stays open, and rows read as binary the same as text."""
    [rows] = pg_pipeline.run(conn, [(_INSERT, {"k": 1, "x": 0.25})], commit=False)
    assert rows == [(1, 0.25)]
    assert conn.pgconn.transaction_status == pq.TransactionStatus.INTRANS
    assert _stored(url) == []
    params = {
        "i": 2**62 + 1, "f": -0.0, "t": "t", "b": bytes(range(256)), "n": 3, "a": [],
    }  # fmt: skip
    [binary] = pg_pipeline.run(conn, [(_ROW, params)], commit=False, binary=True)
    [text] = pg_pipeline.run(conn, [(_ROW, params)], commit=False)
    assert (
        binary == text == [(2**62 + 1, -0.0, "t", bytes(range(256)), 3, (2**62 + 1) % 7, [], "x%y")]
    )
    assert math.copysign(1.0, binary[0][1]) == math.copysign(1.0, text[0][1]) == -1.0
    conn.commit()
    assert _stored(url) == [1]


def test_a_finalisation_locks_its_steps_and_reads_their_parts_in_one_round_trip(
    run_conn: tuple[sa.Connection, psycopg.Connection], tmp_path: Path, postgres_url: str
) -> None:
    """The steps' rows come locked, in step order, each step's parts as ``read_parts``
    reads them and the run's key as ``KnownRuns`` reads it; a step not asked for is
    read as before."""
    conn, driver = run_conn
    for step in (3, 4, 5):
        _open_step(driver, step, 2, 16, 16, 62, 0.5, 60.25)
        for rank in (0, 1):
            driver.execute(
                "INSERT INTO partials VALUES (1, %s, %s, 8, %s)", (step, rank, bytes([step, rank]))
            )
            driver.execute("INSERT INTO commits VALUES (1, %s, %s, 8)", (step, rank))
    driver.commit()
    dialect = PostgresDialect()
    trace = tmp_path / "trace"
    with _traced(driver, trace):
        rows, read, key = dialect.lock_steps(conn, 1, [5, 3, 9])
        parts = {s: read(conn, 1, s) for s in (3, 5)}
    assert _syncs(trace) == 1
    assert key == tuple(conn.execute(sql_run._CURRENT, {"run": 1}).one())
    assert key == ("{}", 64, 60.0, 0)  # the spec, world size, step timeout, metrics
    assert [(r.step, r.received, r.missing_ranks, r.deadline) for r in rows] == [
        (3, 16, 62, 60.25),
        (5, 16, 62, 60.25),
    ]
    for step in (3, 5):
        assert parts[step] == read_parts(conn, 1, step)
        assert parts[step][0] == [(r, 8, bytes([step, r])) for r in (0, 1)]
    assert read(conn, 1, 4) == read_parts(conn, 1, 4)  # not locked here: read as before
    with psycopg.connect(postgres_url.replace("postgresql+psycopg://", "postgresql://")) as other:
        with pytest.raises(psycopg.errors.LockNotAvailable):
            other.execute("SELECT 1 FROM steps WHERE run_id = 1 AND step = 3 FOR UPDATE NOWAIT")
        other.rollback()
        other.execute("SELECT 1 FROM steps WHERE run_id = 1 AND step = 4 FOR UPDATE NOWAIT")
    driver.rollback()


def test_a_statement_planned_each_time_is_never_prepared(conn: psycopg.Connection) -> None:
    for k in (1, 2):
        [rows] = pg_pipeline.run(conn, [(_INSERT, {"k": k, "x": 0.5})], plan_each={_INSERT})
        assert rows == [(k, 0.5)]
    texts = [t for (t,) in conn.execute("SELECT statement FROM pg_prepared_statements")]
    conn.rollback()
    assert not [t for t in texts if "round_trip_t" in t]


def test_a_finalisation_after_its_groups_commit_ends_with_its_writes(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch that completes a step: its group's round trip, then the finalisation's
    — the rows locked, the parts read and the run's spec looked at, then the writes
    with the ``COMMIT`` — and no round trip more for the commit; what it wrote is
    committed."""
    from fastapi.testclient import TestClient

    from steptally.service.app import create_app
    from steptally.service.settings import Settings
    from tests.integration.conftest import _empty
    from tests.integration.test_ingest_lane import JSON, _rows

    _empty(postgres_url)
    trace = tmp_path / "trace"
    traced: list[psycopg.Connection] = []
    run = pg_pipeline.run

    def tracing(driver: psycopg.Connection, *args: Any, **kwargs: Any) -> Any:
        if not traced:  # the writer's connection, from the next pipeline on
            traced.append(driver)
            driver.pgconn.trace(files.enter_context(trace.open("w")).fileno())
            driver.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        return run(driver, *args, **kwargs)

    settings = Settings(database_url=postgres_url, ingest_writers=1, ingest_loop_writer=False)
    app = create_app(settings, sweep=False)  # a writer thread's group
    with TestClient(app) as client, ExitStack() as files:
        spec = {"name": "r", "world_size": 2, "metrics": {"a": "sum", "n": "count"}}
        assert client.post("/v1/runs", json=spec).status_code == 201
        for rank in (0, 1):  # step 0, finalised: the store knows the run's spec since
            body = _rows((0, rank, 0, {"a": 1.0, "n": 1}), commits=[(0, rank, 1)])
            assert client.post("/v1/runs/r/fragments", content=body, headers=JSON).is_success
        first = _rows((1, 0, 0, {"a": 1.5, "n": 1}), commits=[(1, 0, 1)])
        assert (
            client.post("/v1/runs/r/fragments", content=first, headers=JSON).json()["finalised"]
            == []
        )
        monkeypatch.setattr(pg_pipeline, "run", tracing)
        last = _rows((1, 1, 0, {"a": 2.5, "n": 1}), commits=[(1, 1, 1)])
        answer = client.post("/v1/runs/r/fragments", content=last, headers=JSON).json()
        assert answer["finalised"] == [{"step": 1, "status": "complete", "revision": 1}]
        [driver] = traced
        driver.pgconn.untrace()  # the writer waits for the next group: its trace is whole
        # the group; the rows locked, the parts read and the run's spec looked at
        # (unchanged); the writes with the commit, and nothing after them
        sent = re.findall(r"^F\t\d+\t(\w+)\t? ?(.*)$", trace.read_text(), re.MULTILINE)
        # a round trip: a pipeline's Sync, or a simple query (psycopg's own COMMIT)
        assert sum(kind in ("Sync", "Query") for kind, _ in sent) == 3
        commits = [i for i, (_, text) in enumerate(sent) if '"COMMIT"' in text]
        # the finalisation's, with its writes (the group's transaction is implicit: it
        # commits at its Sync)
        assert len(commits) == 1
        assert not any('"BEGIN"' in text for _, text in sent[: sent.index(("Sync", ""))])
        assert sent[commits[-1] - 3][1].startswith('"" "steptally_')  # after a write
        assert [kind for kind, _ in sent[commits[-1] :]] == [
            "Parse", "Bind", "Describe", "Execute", "Sync"
        ]  # fmt: skip
        assert driver.pgconn.transaction_status == pq.TransactionStatus.IDLE
        with psycopg.connect(postgres_url.replace("postgresql+psycopg://", "postgresql://")) as c:
            status = c.execute("SELECT status FROM steps WHERE step = 1").fetchone()
        assert status == ("complete",)
