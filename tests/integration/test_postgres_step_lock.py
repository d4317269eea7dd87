"""A fresh group's writes on PostgreSQL take its steps' rows last: two groups of one
step, from two workers or replicas, make their inserts side by side and wait on each
other only for the step row's update and the commit."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psycopg
import pytest
from fastapi.testclient import TestClient

from steptally.service.app import create_app
from steptally.service.settings import Settings
from tests.integration.test_ingest_lane import JSON, _rows

pytestmark = pytest.mark.postgres


def test_a_groups_inserts_do_not_wait_for_its_steps_row(
    postgres_url: str, empty_database: Callable[[str], None]
) -> None:
    empty_database(postgres_url)
    plain = postgres_url.replace("postgresql+psycopg://", "postgresql://")
    app = create_app(Settings(database_url=postgres_url), sweep=False)
    with TestClient(app) as client:
        spec = {"name": "r", "world_size": 4, "metrics": {"a": "sum", "n": "count"}}
        assert client.post("/v1/runs", json=spec).status_code == 201
        first = _rows((0, 0, 0, {"a": 1.0, "n": 1}), commits=[(0, 0, 1)])
        assert (
            client.post("/v1/runs/r/fragments", content=first, headers=JSON).json()["commits"] == 1
        )
        with psycopg.connect(plain) as holder, psycopg.connect(plain) as probe:
            run_id = holder.execute("SELECT id FROM runs WHERE name = 'r'").fetchone()
            assert run_id is not None
            holder.execute("SELECT 1 FROM steps WHERE step = 0 FOR UPDATE")  # held
            answers: list[dict[str, int]] = []
            second = _rows((0, 1, 0, {"a": 2.0, "n": 1}), commits=[(0, 1, 1)])
            post = threading.Thread(
                target=lambda: answers.append(
                    client.post("/v1/runs/r/fragments", content=second, headers=JSON).json()
                )
            )
            post.start()
            time.sleep(0.5)
            assert not answers  # waiting for the step's row
            # the group's commit row is inserted already: the same key waits for it
            probe.execute("SET lock_timeout = '200ms'")
            with pytest.raises(psycopg.errors.LockNotAvailable):
                probe.execute(
                    "INSERT INTO commits (run_id, step, rank, fragments) VALUES (%s, 0, 1, 1) "
                    "ON CONFLICT DO NOTHING",
                    (run_id[0],),
                )
            probe.rollback()
            holder.rollback()  # the step's row let go: the group goes on and commits
            post.join(10)
        assert answers == [{"accepted": 1, "duplicates": 0, "commits": 1, "finalised": []}]
