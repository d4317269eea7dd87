"""The store configurations every contract test runs against, built by the one factory.

``store`` is parametrised over SQLite, PostgreSQL, and PostgreSQL with Redis
(``redis_url`` set: the schedule of open steps in Redis). Each database is created
and migrated once per session (PostgreSQL: a fresh ``steptally_contract_<pid>``,
dropped at the end) and emptied before each test; each Redis test has a key prefix of
its own, deleted afterwards. The Redis configuration runs when Redis answers on
127.0.0.1:6379 and is skipped, saying so, when it does not.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from steptally.service.settings import Settings
from steptally.service.store.factory import open_store
from steptally.service.store.migration import upgrade
from steptally.service.store.protocol import Store
from tests.support.redis_server import SHARED_REDIS, delete_prefix, private_prefix

TABLES = ("breaches", "partials", "step_values", "fragments", "commits", "steps", "metrics", "runs")
CONFIGURATIONS = [
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("postgres+redis", marks=[pytest.mark.postgres, pytest.mark.redis]),
]


@pytest.fixture(scope="session")
def contract_sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{Path(tmp_path_factory.mktemp('contract')) / 'steptally.sqlite3'}"
    upgrade(url)
    return url


@pytest.fixture(scope="session")
def contract_postgres_url(pg_admin_url: str) -> Iterator[str]:
    name = f"steptally_contract_{os.getpid()}"
    admin = sa.create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            conn.exec_driver_sql(f"CREATE DATABASE {name}")
    except sa.exc.OperationalError as exc:
        admin.dispose()
        pytest.fail(f"PostgreSQL is not reachable at {pg_admin_url}: {exc}")
    url = pg_admin_url.rsplit("/", 1)[0] + "/" + name
    try:
        upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.dispose()


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


def _redis_up() -> bool:
    client = redis.Redis.from_url(SHARED_REDIS, socket_connect_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


@pytest.fixture(params=CONFIGURATIONS)
def settings(request: pytest.FixtureRequest) -> Iterator[Settings]:
    """The settings of one store configuration, over an empty, migrated database."""
    configuration: str = request.param
    database = configuration.split("+", 1)[0]
    url: str = request.getfixturevalue(f"contract_{database}_url")
    _empty(url)
    if not configuration.endswith("+redis"):
        yield Settings(database_url=url)
        return
    if not _redis_up():
        pytest.skip(f"Redis does not answer at {SHARED_REDIS}")
    prefix = private_prefix()
    try:
        yield Settings(database_url=url, redis_url=SHARED_REDIS, redis_prefix=prefix)
    finally:
        delete_prefix(SHARED_REDIS, prefix)


@pytest.fixture
def store(settings: Settings) -> Iterator[Store]:
    """The store ``settings`` describe, as the app gets it; closed at the end."""
    opened = open_store(settings)
    try:
        yield opened
    finally:
        opened.close()
