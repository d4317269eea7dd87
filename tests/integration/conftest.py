"""Fixtures of the service's integration tests: real SQLite and PostgreSQL databases.

Each database is created and migrated once per session (PostgreSQL: a fresh
``steptally_test_<pid>`` database, dropped at the end) and emptied before each test.
``db_url`` is parametrised over both, so every test using it runs on both.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from fastapi import FastAPI
from fastapi.testclient import TestClient

from steptally.service.app import create_app
from steptally.service.settings import Settings
from steptally.service.store.migration import upgrade
from tests.support.redis_server import SHARED_REDIS, delete_prefix, private_prefix
from tests.support.served import ServedService

TABLES = (
    "breaches", "partials", "step_values", "fragments", "commits", "steps", "metrics", "runs",
    "tokens",
)  # fmt: skip


class Clock:
    """A settable clock for apps under test."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = Path(tmp_path_factory.mktemp("sqlite")) / "steptally.sqlite3"
    url = f"sqlite:///{path}"
    upgrade(url)
    return url


@contextmanager
def own_database(admin_url: str, name: str) -> Iterator[str]:
    """A PostgreSQL database ``name``, created empty (no schema) from ``admin_url``'s
    server and dropped at the end; its URL."""
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            conn.exec_driver_sql(f"CREATE DATABASE {name}")
    except sa.exc.OperationalError as exc:
        admin.dispose()
        pytest.fail(f"PostgreSQL is not reachable at {admin_url}: {exc}")
    try:
        yield admin_url.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.dispose()


@pytest.fixture(scope="session")
def postgres_url(pg_admin_url: str) -> Iterator[str]:
    with own_database(pg_admin_url, f"steptally_test_{os.getpid()}") as url:
        upgrade(url)
        yield url


def _empty(url: str) -> None:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            if engine.dialect.name == "postgresql":
                conn.exec_driver_sql(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE")
            else:
                for table in TABLES:
                    conn.exec_driver_sql(f"DELETE FROM {table}")
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    """An empty, migrated database: SQLite, then PostgreSQL."""
    url: str = request.getfixturevalue(f"{request.param}_url")
    _empty(url)
    return url


@pytest.fixture
def served(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServedService]:
    """A started ``steptally serve`` on ``db_url`` whose sweeper runs every 0.1 s."""
    monkeypatch.setenv("STEPTALLY_SWEEP_INTERVAL_S", "0.1")
    service = ServedService(db_url, tmp_path / "serve.log").start()
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture
def empty_database() -> Callable[[str], None]:
    """``empty_database(url)``: delete every row, keep the schema."""
    return _empty


@pytest.fixture
def clock() -> Clock:
    return Clock()


AppFactory = Callable[..., tuple[FastAPI, TestClient]]


@pytest.fixture
def make_client(db_url: str, clock: Clock) -> Iterator[AppFactory]:
    """Build apps over ``db_url`` (several, like replicas); all are closed at the end."""
    with ExitStack() as stack:

        def make(**settings: Any) -> tuple[FastAPI, TestClient]:
            sweep = settings.pop("sweep", False)
            app = create_app(Settings(database_url=db_url, **settings), clock=clock, sweep=sweep)
            return app, stack.enter_context(TestClient(app))

        yield make


@pytest.fixture
def app_and_client(make_client: AppFactory) -> tuple[FastAPI, TestClient]:
    return make_client()


@pytest.fixture
def app(app_and_client: tuple[FastAPI, TestClient]) -> FastAPI:
    return app_and_client[0]


@pytest.fixture
def client(app_and_client: tuple[FastAPI, TestClient]) -> TestClient:
    return app_and_client[1]


class Api:
    """Terse calls of the REST API for tests."""

    def __init__(self, client: TestClient) -> None:
        self.client = client

    def register(
        self,
        name: str = "r",
        world_size: int = 2,
        metrics: dict[str, str] | None = None,
        derived: dict[str, str] | None = None,
        step_timeout_s: float = 60.0,
    ) -> Any:
        body = {
            "name": name,
            "world_size": world_size,
            "metrics": metrics if metrics is not None else {"a": "sum", "n": "count"},
            "derived": derived or {},
            "step_timeout_s": step_timeout_s,
        }
        return self.client.post("/v1/runs", json=body)

    def send(
        self,
        fragments: list[tuple[int, int, int, dict[str, Any]]] = (),  # type: ignore[assignment]
        commits: list[tuple[int, int, int]] = (),  # type: ignore[assignment]
        run: str = "r",
    ) -> Any:
        body = {
            "fragments": [
                {"step": s, "rank": r, "seq": q, "values": v} for s, r, q, v in fragments
            ],
            "commits": [{"step": s, "rank": r, "fragments": n} for s, r, n in commits],
        }
        return self.client.post(f"/v1/runs/{run}/fragments", json=body)

    def step(self, step: int, run: str = "r") -> dict[str, Any]:
        response = self.client.get(f"/v1/runs/{run}/steps/{step}")
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def value(self, step: int, metric: str, run: str = "r") -> Any:
        return self.step(step, run)["metrics"][metric]["value"]


@pytest.fixture
def api(client: TestClient) -> Api:
    return Api(client)


@pytest.fixture
def api_of() -> type[Api]:
    """``api_of(client)``: the same helper over another client (another replica)."""
    return Api


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    """A private key prefix on the shared Redis, its keys deleted afterwards."""
    prefix = private_prefix()
    yield prefix
    delete_prefix(SHARED_REDIS, prefix)


@pytest.fixture
def shared_redis() -> Iterator[redis.Redis]:
    """A client of the shared Redis."""
    client = redis.Redis.from_url(SHARED_REDIS)
    yield client
    client.close()
