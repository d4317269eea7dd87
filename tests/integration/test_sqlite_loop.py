"""SQLite's groups of plain pairs stored by the event loop (``service/store/sqlite_loop.py``),
through the app on a real database file: exact, answered once synced, finalising the
steps they complete; what is not plain, or finds the writer lock held, stored by the
writer threads; a failed sync answered as an error, never as stored."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi.testclient import TestClient

from steptally.service.app import create_app
from steptally.service.settings import Settings
from steptally.service.store.dialect import SqliteDialect
from steptally.service.store.group_commit import Pending
from steptally.service.store.migration import upgrade
from steptally.service.store.sql import SqlStore
from tests.integration.test_loop_writer import JSON, _body


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'loop.sqlite3'}"
    upgrade(url)
    return url


@pytest.fixture
def stores(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """The groups stored, by the thread that stored them (the loop's ``store_held``, or
    a writer thread's ``_ingest_group``), each by its number of batches."""
    seen: dict[str, list[int]] = {"loop": [], "threads": []}
    held, threads = SqlStore.store_held, SqlStore._ingest_group

    def on_loop(self: SqlStore, group: list[Pending]) -> None:
        assert not threading.current_thread().name.startswith("steptally-writer")
        seen["loop"].append(len(group))
        held(self, group)

    def on_threads(self: SqlStore, group: list[Pending]) -> None:
        assert threading.current_thread().name.startswith("steptally-writer")
        seen["threads"].append(len(group))
        threads(self, group)

    monkeypatch.setattr(SqlStore, "store_held", on_loop)
    monkeypatch.setattr(SqlStore, "_ingest_group", on_threads)
    return seen


@pytest.fixture
def client(url: str, stores: dict[str, list[int]]) -> Iterator[TestClient]:
    """The app over a fresh database file, run ``r`` (2 ranks) registered."""
    app = create_app(Settings(database_url=url), sweep=False)
    with TestClient(app) as c:
        spec = {"name": "r", "world_size": 2, "metrics": {"a": "sum", "n": "count"}}
        assert c.post("/v1/runs", json=spec).status_code == 201
        yield c


def _post(client: TestClient, body: bytes) -> dict[str, Any]:
    answer = client.post("/v1/runs/r/fragments", content=body, headers=JSON)
    assert answer.status_code == 200, answer.text
    out: dict[str, Any] = answer.json()
    return out


def _metrics(client: TestClient, step: int) -> tuple[Any, Any]:
    metrics = client.get(f"/v1/runs/r/steps/{step}").json()["metrics"]
    return metrics["a"]["value"], metrics["n"]["value"]


def test_the_loop_stores_plain_groups_and_finalises_what_they_complete(
    client: TestClient, stores: dict[str, list[int]]
) -> None:
    assert _post(client, _body((0, 0, 0.5)))["finalised"] == []
    assert _post(client, _body((0, 1, 0.25)))["finalised"] == [
        {"step": 0, "status": "complete", "revision": 1}
    ]
    assert _post(client, _body((1, 0, 1e17), (1, 1, -1e17)))["finalised"] == [
        {"step": 1, "status": "complete", "revision": 1}
    ]
    assert stores == {"loop": [1, 1, 1], "threads": []}
    assert _metrics(client, 0) == (0.75, 2.0)
    assert _metrics(client, 1) == (0.0, 2.0)  # 1e17 - 1e17 exactly, summed once


def test_what_is_not_plain_and_what_is_stored_already_answer_as_before(
    client: TestClient, stores: dict[str, list[int]]
) -> None:
    assert _post(client, _body((0, 0, 0.5)))["accepted"] == 1
    again = _post(client, _body((0, 0, 0.5)))  # the plain write refuses, the probe's path says
    assert (again["accepted"], again["duplicates"], again["commits"]) == (0, 1, 0)
    assert stores == {"loop": [1, 1], "threads": []}
    loose = _post(client, _body((0, 1, 0.25), commit=False))  # no commit: not plain
    assert loose["accepted"] == 1 and stores["threads"] == [1]
    done = _post(client, orjson.dumps({"commits": [{"step": 0, "rank": 1, "fragments": 1}]}))
    assert done["finalised"] == [{"step": 0, "status": "complete", "revision": 1}]
    assert stores == {"loop": [1, 1], "threads": [1, 1]}
    assert _metrics(client, 0) == (0.75, 2.0)


def test_a_held_writer_lock_sends_the_group_to_the_writer_threads(
    client: TestClient, stores: dict[str, list[int]]
) -> None:
    """Another writer holds the lock (here a thread of the test's; another process's
    writer takes the same lock's file): the loop does not wait for it, the writer
    threads store the group once it is free, and the batch is answered then."""
    store = client.app.state.store  # type: ignore[attr-defined]
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with store._writers:
            holding.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    holding.wait(5)
    threading.Timer(0.3, release.set).start()
    started = time.monotonic()
    assert _post(client, _body((0, 0, 0.5)))["accepted"] == 1
    assert time.monotonic() - started >= 0.25  # answered once the lock was free
    holder.join()
    assert stores == {"loop": [], "threads": [1]}
    assert _post(client, _body((0, 1, 0.25)))["finalised"][0]["step"] == 0
    assert stores == {"loop": [1], "threads": [1]}
    assert _metrics(client, 0) == (0.75, 2.0)


def test_a_failed_sync_is_answered_as_an_error(
    client: TestClient, stores: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Committed but not known durable: the batch is not acknowledged (the client
    sends it again, and it is then a duplicate); the next group syncs as before."""
    sync = SqliteDialect.sync

    def failing(self: SqliteDialect) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(SqliteDialect, "sync", failing)
    with pytest.raises(OSError, match="Input/output error"):  # the app answers 500
        client.post("/v1/runs/r/fragments", content=_body((0, 0, 0.5)), headers=JSON)
    monkeypatch.setattr(SqliteDialect, "sync", sync)
    again = _post(client, _body((0, 0, 0.5)))
    assert (again["accepted"], again["duplicates"]) == (0, 1)
    assert _post(client, _body((0, 1, 0.25)))["finalised"][0]["step"] == 0
    assert stores["loop"] == [1, 1, 1]
    assert _metrics(client, 0) == (0.75, 2.0)


def test_turned_off_the_writer_threads_store_every_group(
    url: str, stores: dict[str, list[int]]
) -> None:
    app = create_app(Settings(database_url=url, ingest_loop_writer=False), sweep=False)
    with TestClient(app) as c:
        spec = {"name": "r", "world_size": 2, "metrics": {"a": "sum", "n": "count"}}
        assert c.post("/v1/runs", json=spec).status_code == 201
        assert _post(c, _body((0, 0, 1.0), (0, 1, 1.0)))["finalised"][0]["step"] == 0
        assert app.state.store._loop_writers == {}
    assert stores == {"loop": [], "threads": [1]}
    # in memory, each connection would hold a database of its own: no loop writer
    assert [SqliteDialect(d).in_file for d in (None, ":memory:", "s.db")] == [False, False, True]
