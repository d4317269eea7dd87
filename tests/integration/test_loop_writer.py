"""PostgreSQL's groups of plain pairs written by the event loop (``service/store/pg_loop.py``),
through the app against real PostgreSQL: exact, answered once durable, finalising the
steps they complete; what is not new, or not plain, stored by the writer threads; a
lost connection failing only the group sent on it, and another opened."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import psycopg
import pytest
from fastapi.testclient import TestClient

from steptally.service.app import create_app
from steptally.service.settings import Settings
from steptally.service.store import pg_pipeline, sql_ingest
from steptally.service.store.sql_statement import PIPELINE
from tests.integration.conftest import _empty

pytestmark = pytest.mark.postgres

JSON = {"content-type": "application/json"}


def _body(*pairs: tuple[int, int, float], commit: bool = True) -> bytes:
    """One fragment each of ``pairs`` (step, rank, a), each committed (``commit``)."""
    return orjson.dumps(
        {
            "fragments": [
                {"step": s, "rank": r, "seq": 0, "values": {"a": a, "n": 1}} for s, r, a in pairs
            ],
            "commits": [{"step": s, "rank": r, "fragments": 1} for s, r, _ in pairs]
            if commit
            else [],
        }
    )


def _wait(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The groups the loop's writers sent (:func:`.pg_pipeline.send`), by their number
    of pairs."""
    sent: list[int] = []
    send = pg_pipeline.send

    def counting(driver: psycopg.Connection, statements: Any) -> pg_pipeline.Sent:
        [(sql, params)] = statements
        assert sql == PIPELINE.fresh_plain
        sent.append(struct.unpack_from(">i", params["c_step"], 12)[0])  # its length
        return send(driver, statements)

    monkeypatch.setattr(pg_pipeline, "send", counting)
    return sent


@pytest.fixture
def client(postgres_url: str) -> Iterator[TestClient]:
    """The app over an empty database, run ``r`` (2 ranks) registered, its event
    loop's writer connected (the first batch went to the writer threads meanwhile)."""
    _empty(postgres_url)
    app = create_app(Settings(database_url=postgres_url), sweep=False)
    with TestClient(app) as c:
        spec = {"name": "r", "world_size": 2, "metrics": {"a": "sum", "n": "count"}}
        assert c.post("/v1/runs", json=spec).status_code == 201
        first = c.post("/v1/runs/r/fragments", content=_body((0, 0, 0.5)), headers=JSON)
        assert first.json()["accepted"] == 1
        store = app.state.store
        _wait(
            lambda: any(w._driver is not None for w in store._loop_writers.values()),
            "the loop's connection opened",
        )
        yield c


def _post(client: TestClient, body: bytes) -> dict[str, Any]:
    answer = client.post("/v1/runs/r/fragments", content=body, headers=JSON)
    assert answer.status_code == 200, answer.text
    out: dict[str, Any] = answer.json()
    return out


def test_the_loop_writes_plain_groups_and_finalises_what_they_complete(
    client: TestClient, sends: list[int]
) -> None:
    assert _post(client, _body((0, 1, 0.25)))["finalised"] == [
        {"step": 0, "status": "complete", "revision": 1}
    ]
    assert _post(client, _body((1, 0, 1e17)))["finalised"] == []
    done = _post(client, _body((1, 1, -1e17)))
    assert done["finalised"] == [{"step": 1, "status": "complete", "revision": 1}]
    assert sends == [1, 1, 1]
    for step, a in ((0, 0.75), (1, 0.0)):  # 1e17 - 1e17 exactly, summed once
        metrics = client.get(f"/v1/runs/r/steps/{step}").json()["metrics"]
        assert (metrics["a"]["value"], metrics["n"]["value"]) == (a, 2.0)


def test_what_is_not_new_or_not_plain_goes_to_the_writer_threads(
    client: TestClient, sends: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[str] = []
    run = pg_pipeline.run

    def writers(driver: psycopg.Connection, statements: Any, *args: Any, **kw: Any) -> Any:
        ran.extend(sql for sql, _ in statements)
        return run(driver, statements, *args, **kw)

    monkeypatch.setattr(pg_pipeline, "run", writers)
    again = _post(client, _body((0, 0, 0.5)))  # stored before: a duplicate
    assert (again["accepted"], again["duplicates"], again["commits"]) == (0, 1, 0)
    assert sends == [1]  # sent, refused by its keys, nothing written
    assert PIPELINE.pairs_of in ran  # then probed by a writer thread
    ran.clear()
    loose = _post(client, _body((0, 1, 0.25), commit=False))  # no commit: not plain
    assert loose["accepted"] == 1 and sends == [1]
    assert ran  # a writer thread's
    done = _post(client, orjson.dumps({"commits": [{"step": 0, "rank": 1, "fragments": 1}]}))
    assert done["finalised"] == [{"step": 0, "status": "complete", "revision": 1}]
    metrics = client.get("/v1/runs/r/steps/0").json()["metrics"]
    assert (metrics["a"]["value"], metrics["n"]["value"]) == (0.75, 2.0)


def test_a_lost_connection_fails_only_its_group_and_another_is_opened(
    client: TestClient, sends: list[int], postgres_url: str
) -> None:
    store = client.app.state.store  # type: ignore[attr-defined]
    [writer] = store._loop_writers.values()
    pid = writer._driver.info.backend_pid
    dsn = postgres_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as admin:
        assert admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
    stored = 0
    for step in range(1, 6):  # each answered stored, or refused retryably and sent again
        for rank in (0, 1):
            for _ in range(3):
                answer = client.post(
                    "/v1/runs/r/fragments", content=_body((step, rank, 1.0)), headers=JSON
                )
                if answer.status_code == 200:
                    stored += answer.json()["accepted"]
                    break
                assert answer.status_code == 503, answer.text
    assert stored == 10
    _wait(lambda: writer._driver is not None, "another connection opened")
    assert writer._driver.info.backend_pid != pid
    before = len(sends)
    assert _post(client, _body((6, 0, 1.0)))["accepted"] == 1
    assert len(sends) == before + 1  # the loop writes again
    for step in range(1, 6):
        metrics = client.get(f"/v1/runs/r/steps/{step}").json()["metrics"]
        assert (metrics["a"]["value"], metrics["n"]["value"]) == (2.0, 2.0), step


def test_the_loop_writer_can_be_turned_off(postgres_url: str, sends: list[int]) -> None:
    _empty(postgres_url)
    settings = Settings(database_url=postgres_url, ingest_loop_writer=False)
    app = create_app(settings, sweep=False)
    with TestClient(app) as c:
        spec = {"name": "r", "world_size": 2, "metrics": {"a": "sum", "n": "count"}}
        assert c.post("/v1/runs", json=spec).status_code == 201
        for rank in (0, 1):
            c.post("/v1/runs/r/fragments", content=_body((0, rank, 1.0)), headers=JSON)
        assert app.state.store._loop_writers == {}
    assert sends == []


def test_a_group_that_cannot_be_made_is_answered_with_its_error(
    client: TestClient, sends: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault of the service's own while the loop makes a group: its batches are
    answered with it (the test client raises what the app answers 500), nothing is
    sent, and the next group goes as before."""
    fresh_write = sql_ingest.fresh_write

    def broken(*args: Any) -> Any:
        raise ValueError("a fault of ours")

    monkeypatch.setattr(sql_ingest, "fresh_write", broken)
    with pytest.raises(ValueError, match="a fault of ours"):
        client.post("/v1/runs/r/fragments", content=_body((1, 0, 1.0)), headers=JSON)
    assert sends == []
    monkeypatch.setattr(sql_ingest, "fresh_write", fresh_write)
    assert _post(client, _body((1, 0, 1.0)))["accepted"] == 1
    assert sends == [1]
