"""How many writer threads a store starts: the database's default, or one in a process
that may run on one core only (``serve --cpus``, ``taskset``, a one-CPU container),
unless ``STEPTALLY_INGEST_WRITERS`` says otherwise.

Each case runs in a process of its own, so that the cores it is kept on are its own:
the app stores one batch that is not plain (the writers start with the first they
take), then names its threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from steptally.service.store.dialect import SqliteDialect
from steptally.service.store.sql_postgres import PostgresDialect

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, threading
    from fastapi.testclient import TestClient
    from steptally.service.app import create_app
    from steptally.service.settings import Settings

    cores = json.loads(sys.argv[2])
    if cores:
        os.sched_setaffinity(0, cores)
    with TestClient(create_app(Settings(database_url=sys.argv[1]), sweep=False)) as client:
        run = {"name": "w", "world_size": 1, "metrics": {"a": "sum"}}
        assert client.post("/v1/runs", json=run).status_code in (200, 201)
        # no commit: not plain, so a writer thread stores it (the event loop stores
        # plain groups itself, service/store/sqlite_loop.py and pg_loop.py)
        body = {"fragments": [{"step": 0, "rank": 0, "seq": 0, "values": {"a": 1.0}}]}
        answer = client.post("/v1/runs/w/fragments", json=body)
        assert answer.status_code == 200, answer.text
        names = [t.name for t in threading.enumerate()]
    print(json.dumps(sorted(n for n in names if n.startswith("steptally-writer"))))
    """
)


def _writers(url: str, cores: list[int], tmp_path: Path, **env: str) -> list[str]:
    script = tmp_path / "writers.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), url, json.dumps(cores)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    names: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return names


def _default(url: str) -> int:
    return (SqliteDialect if url.startswith("sqlite") else PostgresDialect).default_writers


def test_a_process_on_one_core_starts_one_writer(db_url: str, tmp_path: Path) -> None:
    core = max(os.sched_getaffinity(0))
    assert _writers(db_url, [core], tmp_path) == ["steptally-writer-0"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to run on")
def test_a_process_on_several_cores_starts_the_databases_default(
    db_url: str, tmp_path: Path
) -> None:
    assert _default(db_url) == 2  # else the one-core case above tells nothing
    cores = sorted(os.sched_getaffinity(0))[:2]
    expected = [f"steptally-writer-{i}" for i in range(2)]
    assert _writers(db_url, cores, tmp_path) == expected


def test_writers_set_in_the_settings_are_kept_on_one_core(db_url: str, tmp_path: Path) -> None:
    core = max(os.sched_getaffinity(0))
    names = _writers(db_url, [core], tmp_path, STEPTALLY_INGEST_WRITERS="3")
    assert names == [f"steptally-writer-{i}" for i in range(3)]
