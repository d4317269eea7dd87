"""The real reporter with tokens against a real ``steptally serve`` with auth on, on
SQLite and PostgreSQL: a bound ingest token registers and delivers its run (given or
from ``STEPTALLY_TOKEN``); a token revoked mid-run, or one without the ingest scope, is
a refusal that keeps every batch in the spool (never the quarantine), named in
``stats().last_error``, and ``steptally sync`` with a good token delivers it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from support.served import ServedService

from steptally.client.reporter import Reporter, ReporterOptions

SPEC = {"metrics": {"a": "sum", "n": "count"}}
FAST = ReporterOptions(flush_interval_s=0.01, backoff_base_s=0.01, backoff_max_s=0.05)
RUN = "auth-e2e"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'db.sqlite3'}"
        return
    admin_url: str = request.getfixturevalue("pg_admin_url")
    name = f"steptally_auth_e2e_{os.getpid()}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            conn.exec_driver_sql(f"CREATE DATABASE {name}")
        yield admin_url.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.dispose()


def create_token(database_url: str, *args: str) -> str:
    done = ServedService.cli("token", "create", "--database-url", database_url, *args)
    return done.stdout.decode().splitlines()[-1]


@pytest.fixture
def service(database_url: str, tmp_path: Path) -> Iterator[ServedService]:
    svc = ServedService(database_url, tmp_path / "service.log")
    svc.env = {"STEPTALLY_AUTH": "on"}
    svc.ready_token = create_token(database_url, "--scope", "read")
    svc.start()
    try:
        yield svc
    finally:
        svc.stop()


def report(url: str, steps: range, spool: Path, **kwargs: Any) -> Reporter:
    reporter = Reporter(url, run=RUN, spec=SPEC, rank=0, world_size=1, spool_dir=spool,
                        options=FAST, **kwargs)  # fmt: skip
    for step in steps:
        reporter.log(step, {"a": step + 0.5, "n": 2})
        reporter.commit(step)
    return reporter


def step_of(service: ServedService, step: int) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {service.ready_token}"}
    answer = httpx.get(f"{service.url}/v1/runs/{RUN}/steps/{step}", headers=headers)
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def parcels(spool: Path) -> tuple[int, int]:
    """Parcel files in the spool, and in its quarantine."""
    kept = [p for p in spool.glob("*.json*")]
    quarantined = list((spool / "quarantine").glob("*")) if (spool / "quarantine").exists() else []
    return len(kept), len(quarantined)


def test_a_bound_ingest_token_registers_and_delivers(
    service: ServedService, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ingest = create_token(service.database_url, "--scope", "ingest", "--run", RUN)
    closed = report(service.url, range(3), tmp_path / "given", token=ingest).close(10)
    assert closed.delivered and closed.stats.sent == 3 and closed.stats.last_error is None
    monkeypatch.setenv("STEPTALLY_TOKEN", ingest)
    closed = report(service.url, range(3, 5), tmp_path / "from-env").close(10)
    assert closed.delivered and closed.stats.sent == 2
    for step in range(5):
        got = step_of(service, step)
        assert (got["status"], got["metrics"]["a"]["value"]) == ("complete", step + 0.5)


def test_a_revoked_token_keeps_the_spool_for_sync(service: ServedService, tmp_path: Path) -> None:
    ingest = create_token(service.database_url, "--scope", "ingest", "--run", RUN)
    token_id = ingest.split("_")[1]
    spool = tmp_path / "spool"
    reporter = report(service.url, range(1), spool, token=ingest)
    assert reporter.flush(10)
    assert step_of(service, 0)["status"] == "complete"
    ServedService.cli("token", "revoke", "--database-url", service.database_url, token_id)
    for step in range(1, 4):
        reporter.log(step, {"a": step + 0.5, "n": 2})
        reporter.commit(step)
    closed = reporter.close(2)
    stats = closed.stats  # refused for good, as a run that cannot be registered
    assert (stats.sent, stats.spooled, stats.quarantined, stats.failed) == (1, 3, 0, True)
    error = stats.last_error or ""
    assert "refused this reporter's token: HTTP 401 unauthenticated" in error
    assert parcels(spool)[0] >= 1 and parcels(spool)[1] == 0

    fresh = create_token(service.database_url, "--scope", "ingest", "--run", RUN)
    env = {**os.environ, "STEPTALLY_TOKEN": fresh}
    args = [sys.executable, "-m", "steptally.service.cli", "sync", service.url]
    done = subprocess.run([*args, "--spool-root", str(spool)], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "delivered 3 fragments (0 duplicates), rejected 0, left 0" in done.stdout
    assert [step_of(service, s)["status"] for s in range(4)] == ["complete"] * 4


def test_a_token_without_the_ingest_scope_is_refused_and_kept(
    service: ServedService, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    read = service.ready_token
    stats = report(service.url, range(2), spool, token=read).close(2).stats
    assert (stats.sent, stats.spooled, stats.quarantined, stats.failed) == (0, 2, 0, True)
    assert "could not be registered: HTTP 403 forbidden" in (stats.last_error or "")
    assert parcels(spool)[0] >= 1 and parcels(spool)[1] == 0
    headers = {"Authorization": f"Bearer {read}"}
    assert httpx.get(f"{service.url}/v1/runs", headers=headers).json()["runs"] == []
