"""A database that hangs, was never migrated, or is not there, against real
``steptally serve`` processes: 503 JSON with Retry-After within the configured
timeouts (never a hang or a plain-text 500), /readyz 503 within its own timeout, and
one clear line with a non-zero exit from the CLI."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from tests.support.served import ServedService, free_port

SPEC = {"name": "r", "world_size": 1, "metrics": {"a": "sum"}, "step_timeout_s": 60}
BODY = {
    "fragments": [{"step": 0, "rank": 0, "seq": 0, "values": {"a": 2.5}}],
    "commits": [{"step": 0, "rank": 0, "fragments": 1}],
}


@pytest.fixture
def served(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., ServedService]]:
    started: list[ServedService] = []

    def start(**settings: str) -> ServedService:
        for name, value in settings.items():
            monkeypatch.setenv(f"STEPTALLY_{name.upper()}", value)
        service = ServedService(db_url, tmp_path / f"serve-{len(started)}.log", migrate=False)
        started.append(service.start())
        return service

    yield start
    for service in started:
        service.stop()


@contextmanager
def held_lock(url: str, table: str) -> Iterator[None]:
    """Another connection holds ``table`` (PostgreSQL) or the database's write lock
    (SQLite) until the block ends."""
    if url.startswith("sqlite"):
        conn = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        conn.execute("BEGIN EXCLUSIVE")
        try:
            yield
        finally:
            conn.execute("ROLLBACK")
            conn.close()
        return
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn, conn.begin() as tx:
            conn.exec_driver_sql(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
            yield
            tx.rollback()
    finally:
        engine.dispose()


def _unavailable(answer: httpx.Response) -> None:
    assert answer.status_code == 503, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert answer.headers["retry-after"] == "5"
    assert answer.json()["error"]["code"] == "unavailable"


def test_a_held_lock_is_503_unavailable_within_the_statement_timeout(
    db_url: str, served: Callable[..., ServedService]
) -> None:
    service = served(database_statement_timeout_s="0.5")
    with httpx.Client(base_url=service.url, timeout=30) as http:
        assert http.post("/v1/runs", json=SPEC).status_code == 201
        with held_lock(db_url, "steps"):
            started = time.monotonic()
            _unavailable(http.post("/v1/runs/r/fragments", json=BODY))
            read = http.get("/v1/runs/r/steps/0")
            if db_url.startswith("sqlite"):  # WAL: readers go on, and nothing was stored
                assert read.json()["error"]["code"] == "unknown_step"
            else:
                _unavailable(read)
            took = time.monotonic() - started
        answer = http.post("/v1/runs/r/fragments", json=BODY)  # the retry, once free
        assert answer.status_code == 200, answer.text
        assert answer.json()["finalised"] == [{"step": 0, "status": "complete", "revision": 1}]
        assert http.get("/v1/runs/r/steps/0").json()["metrics"]["a"]["value"] == 2.5
    assert took < 5, took


@pytest.mark.postgres
def test_readyz_is_503_within_its_own_timeout_while_the_database_hangs(
    postgres_url: str, served: Callable[..., ServedService], db_url: str
) -> None:
    if db_url != postgres_url:
        pytest.skip("a lock on one table of PostgreSQL")
    service = served(readyz_timeout_s="0.3")
    with held_lock(postgres_url, "alembic_version"):
        started = time.monotonic()
        answer = httpx.get(f"{service.url}/readyz", timeout=30)
        took = time.monotonic() - started
    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "5"
    assert answer.json()["error"] == {
        "code": "not_ready",
        "message": "the database did not answer within 0.3 s",
        "where": None,
    }
    assert took < 1.5, took
    assert httpx.get(f"{service.url}/readyz").status_code == 200


def test_readyz_is_503_on_a_database_that_is_not_migrated(
    db_url: str, served: Callable[..., ServedService]
) -> None:
    service = served()
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        (version,) = conn.exec_driver_sql("SELECT version_num FROM alembic_version").one()
        conn.exec_driver_sql("DELETE FROM alembic_version")
    try:
        answer = httpx.get(f"{service.url}/readyz")
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"INSERT INTO alembic_version VALUES ('{version}')")
        engine.dispose()
    assert answer.status_code == 503
    error = answer.json()["error"]
    assert error["code"] == "not_ready"
    assert "is not migrated; run `steptally migrate" in error["message"]
    assert httpx.get(f"{service.url}/readyz").status_code == 200


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "steptally.service.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


CLOSED = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test"


@pytest.mark.parametrize("command", ["serve", "migrate"])
@pytest.mark.parametrize(
    ("url", "says"),
    [
        (CLOSED, "Connection refused"),
        ("postgresql+psycopg://nobody@127.0.0.1:5432/test", 'role "nobody" does not exist'),
        ("notaurl", "Could not parse SQLAlchemy URL"),
    ],
)
def test_a_wrong_database_url_is_one_clear_line(command: str, url: str, says: str) -> None:
    done = _cli(command, "--database-url", url, "--port", str(free_port()))
    if command == "migrate":
        done = _cli(command, "--database-url", url)
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("steptally: cannot reach the database ")
    assert says in line
    assert done.stdout == ""


def test_serve_exits_non_zero_when_its_workers_cannot_start(db_url: str, tmp_path: Path) -> None:
    # every worker process (and only they) sees a setting that cannot parse
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if any('multiprocessing' in a for a in sys.argv):\n"
        "    os.environ['STEPTALLY_SWEEP_INTERVAL_S'] = 'never'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    command = [sys.executable, "-m", "steptally.service.cli", "serve", "--workers", "2"]
    args = ["--database-url", db_url, "--port", str(free_port())]
    done = subprocess.run([*command, *args], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2
    assert (
        "steptally: a worker cannot start: invalid setting sweep_interval_s: "
        "Input should be a valid number, unable to parse string as a number"
    ) in done.stderr.splitlines()
    assert done.stderr.splitlines()[-1] == (
        "steptally: cannot serve: the 2 workers did not start (see above)"
    )


class StoppedBackends:
    """Every PostgreSQL backend serving ``database`` but this one, stopped with SIGSTOP
    (and each new one as it appears) until :meth:`resume`: a database that still holds
    its connections open and never answers, deaf to statement timeouts and cancels."""

    def __init__(self, url: str) -> None:
        self._engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        self._conn = self._engine.connect()
        self._stopped: set[int] = set()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._stop_forever, daemon=True)
        self._thread.start()

    def _others(self) -> list[int]:
        rows = self._conn.exec_driver_sql(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        )
        return [int(pid) for (pid,) in rows]

    def _stop_forever(self) -> None:
        while not self._halt.is_set():
            for pid in self._others():
                if pid not in self._stopped:
                    os.kill(pid, signal.SIGSTOP)
                    self._stopped.add(pid)
            self._halt.wait(0.02)

    def resume(self) -> None:
        self._halt.set()
        self._thread.join(10)
        for pid in self._stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self._conn.close()
        self._engine.dispose()


@pytest.mark.postgres
def test_a_stopped_database_backend_is_503_within_the_request_timeout(
    postgres_url: str, served: Callable[..., ServedService], db_url: str
) -> None:
    """A stopped backend never runs its statement timeout: the request's own deadline
    answers instead, the service stays responsive, and nothing acknowledged is lost."""
    if db_url != postgres_url:
        pytest.skip("stops PostgreSQL's backends")
    # one writer: its connection is among the stopped ones (a second writer would open
    # a new connection and store the batch, which is the better answer but not this test)
    service = served(request_timeout_s="1.5", readyz_timeout_s="0.5", ingest_writers="1")
    second = {
        "fragments": [{"step": 1, "rank": 0, "seq": 0, "values": {"a": 0.75}}],
        "commits": [{"step": 1, "rank": 0, "fragments": 1}],
    }
    with httpx.Client(base_url=service.url, timeout=30) as http:
        assert http.post("/v1/runs", json=SPEC).status_code == 201
        assert http.post("/v1/runs/r/fragments", json=BODY).status_code == 200
        frozen = StoppedBackends(postgres_url)
        try:
            time.sleep(0.1)
            started = time.monotonic()
            # the writer's connection is a stopped one: ingest hangs on it
            _unavailable(http.post("/v1/runs/r/fragments", json=second))
            took = time.monotonic() - started
            assert http.get("/healthz").status_code == 200  # the service itself answers
        finally:
            frozen.resume()
        deadline = time.monotonic() + 30
        while (answer := http.post("/v1/runs/r/fragments", json=second)).status_code == 503:
            assert time.monotonic() < deadline, answer.text
            time.sleep(0.2)
        assert answer.status_code == 200, answer.text
        step = http.get("/v1/runs/r/steps/1").json()
        assert (step["status"], step["revision"]) == ("complete", 1)
        assert step["metrics"]["a"]["value"] == 0.75
        assert http.get("/v1/runs/r/steps/0").json()["metrics"]["a"]["value"] == 2.5
    assert 1.5 <= took < 3.0, took
