"""PostgreSQL's groups of plain pairs written by the event loop (``service/store/pg_loop.py``),
through the app against real PostgreSQL: exact, answered once durable, finalising the
steps they complete; what is not new, or not plain, stored by the writer threads; a
lost connection failing only the group sent on it, and another opened."""

from __future__ import annotations

import logging
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
from steptally.service.store import pg_loop, pg_pipeline, sql_ingest
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
def texts(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The statements of each group the loop's writers sent (:func:`.pg_pipeline.send`)."""
    sent: list[list[str]] = []
    send = pg_pipeline.send

    def recording(driver: psycopg.Connection, statements: Any) -> pg_pipeline.Sent:
        sent.append([sql for sql, _ in statements])
        return send(driver, statements)

    monkeypatch.setattr(pg_pipeline, "send", recording)
    return sent


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch, texts: list[list[str]]) -> list[int]:
    """The groups the loop's writers sent, by their number of pairs."""
    sent: list[int] = []
    send = pg_pipeline.send

    def counting(driver: psycopg.Connection, statements: Any) -> pg_pipeline.Sent:
        (sql, params), *_ = statements
        assert sql == PIPELINE.fresh_plain
        sent.append(struct.unpack_from(">i", params["c_step"], 12)[0])  # its length
        return send(driver, statements)

    monkeypatch.setattr(pg_pipeline, "send", counting)
    return sent


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The statements the writer threads and finalisations ran (:func:`.pg_pipeline.run`)."""
    out: list[str] = []
    run = pg_pipeline.run

    def recording(driver: psycopg.Connection, statements: Any, *args: Any, **kw: Any) -> Any:
        out.extend(sql for sql, _ in statements)
        return run(driver, statements, *args, **kw)

    monkeypatch.setattr(pg_pipeline, "run", recording)
    return out


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
    client: TestClient, sends: list[int], ran: list[str]
) -> None:
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


def _finalise_first_step(client: TestClient, run: str = "r") -> None:
    """Step 0 of ``run`` completed by its rank 1 (rank 0 posted): finalised after its
    commit, which reads the run's spec for the store."""
    done = client.post(f"/v1/runs/{run}/fragments", content=_body((0, 1, 0.25)), headers=JSON)
    assert done.json()["finalised"] == [{"step": 0, "status": "complete", "revision": 1}]


def _step(client: TestClient, step: int, run: str = "r") -> dict[str, Any]:
    out: dict[str, Any] = client.get(f"/v1/runs/{run}/steps/{step}").json()
    for key in ("first_seen_at", "finalised_at"):
        assert out.pop(key) is not None, key
    return out


_PAIRS = [(0, 1e17, 0.1), (1, -1e17, 0.2)]  # 1e17 - 1e17 + 0.1 + 0.2, rounded once


def _rank(step: int, rank: int, commit: bool = True, fragments: bool = True) -> dict[str, Any]:
    """Rank ``rank``'s two fragments of ``step`` (of :data:`_PAIRS`) and its commit."""
    _, big, small = _PAIRS[rank]
    return {
        "fragments": [
            {"step": step, "rank": rank, "seq": q, "values": {"a": v, "n": 1}}
            for q, v in enumerate((big, small))
        ]
        if fragments
        else [],
        "commits": [{"step": step, "rank": rank, "fragments": 2}] if commit else [],
    }


def test_a_group_that_completes_a_step_finalises_it_in_its_transaction(
    client: TestClient, texts: list[list[str]], ran: list[str]
) -> None:
    """A group that completes a step finalises it in its own transaction (its row, its
    values), none after it, where the group holds every rank of it (step 2) or the
    loop stored the rest (step 3, a rank a group); where another writer stored some of
    it (step 4's rank 0, not plain, by the writer threads), after the commit. All three
    are stored bit for bit alike."""
    _finalise_first_step(client)
    texts.clear()
    ran.clear()
    whole = {key: [*_rank(2, 0)[key], *_rank(2, 1)[key]] for key in ("fragments", "commits")}
    done = _post(client, orjson.dumps(whole))
    assert done["finalised"] == [{"step": 2, "status": "complete", "revision": 1}]
    inside = [PIPELINE.fresh_plain, PIPELINE.finalise_fresh, PIPELINE.insert_values]
    assert texts == [inside]
    assert _post(client, orjson.dumps(_rank(3, 0)))["finalised"] == []
    done = _post(client, orjson.dumps(_rank(3, 1)))
    assert done["finalised"] == [{"step": 3, "status": "complete", "revision": 1}]
    assert texts == [inside, [PIPELINE.fresh_plain], inside]
    assert ran == []  # no finalisation after a commit
    _post(client, orjson.dumps(_rank(4, 0, commit=False)))  # by the writer threads
    _post(client, orjson.dumps(_rank(4, 0, fragments=False)))
    texts.clear()
    done = _post(client, orjson.dumps(_rank(4, 1)))
    assert done["finalised"] == [{"step": 4, "status": "complete", "revision": 1}]
    assert texts == [[PIPELINE.fresh_plain]]
    assert PIPELINE.locked_steps_of in ran  # finalised after the commit
    steps = {step: _step(client, step) for step in (2, 3, 4)}
    assert steps[2]["metrics"]["a"]["value"] == 0.1 + 0.2 == 0.30000000000000004
    assert steps[2]["metrics"]["n"]["value"] == 4.0
    assert {**steps[2], "step": 4} == {**steps[3], "step": 4} == steps[4]
    series = client.get("/v1/runs/r/series/a").json()  # the stored values, by step
    assert dict(zip(series["steps"], series["values"], strict=True)) == {
        0: 0.75,
        **dict.fromkeys((2, 3, 4), 0.1 + 0.2),
    }


def _with_b(body: bytes, b: float) -> bytes:
    data = orjson.loads(body)
    for f in data["fragments"]:
        f["values"]["b"] = b
    return orjson.dumps(data)


def test_a_metric_added_since_the_store_read_the_run_is_finalised_after_the_commit(
    client: TestClient, texts: list[list[str]], ran: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A metric added to the run after the store last read it: the group's batches are
    made for the run with it, the store's run is without it, so the group's step is
    finalised after the commit, with the run read anew; the next group's inside."""
    _finalise_first_step(client)
    spec = {"name": "r", "world_size": 2, "metrics": {"a": "sum", "n": "count", "b": "sum"}}
    assert client.post("/v1/runs", json=spec).status_code == 200
    texts.clear()
    ran.clear()
    done = _post(client, _with_b(_body((2, 0, 1.5), (2, 1, 2.5)), 0.5))
    assert done["finalised"] == [{"step": 2, "status": "complete", "revision": 1}]
    assert texts == [[PIPELINE.fresh_plain]] and PIPELINE.locked_steps_of in ran
    metrics = client.get("/v1/runs/r/steps/2").json()["metrics"]
    assert (metrics["a"]["value"], metrics["b"]["value"]) == (4.0, 1.0)
    texts.clear()
    ran.clear()
    again = _post(client, _with_b(_body((3, 0, 1.0), (3, 1, 2.0)), 0.25))
    assert again["finalised"] == [{"step": 3, "status": "complete", "revision": 1}]
    assert texts == [[PIPELINE.fresh_plain, PIPELINE.finalise_fresh, PIPELINE.insert_values]]
    assert ran == []
    metrics = client.get("/v1/runs/r/steps/3").json()["metrics"]
    assert (metrics["a"]["value"], metrics["b"]["value"]) == (3.0, 0.5)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_a_run_changed_behind_the_stores_back_fails_the_finalisation_inside(
    client: TestClient, texts: list[list[str]], ran: list[str], postgres_url: str
) -> None:
    """The run changed in the database (here its step timeout, by hand) where neither
    the store nor the lane has read it: the group's finalisation inside finds the run
    not as it took it and fails, the whole transaction with it; the writer threads
    store the group and finalise its step after the commit."""
    _finalise_first_step(client)
    dsn = postgres_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("UPDATE runs SET step_timeout_s = step_timeout_s + 1 WHERE name = 'r'")
    texts.clear()
    ran.clear()
    done = _post(client, _body((2, 0, 1.5), (2, 1, 2.5)))
    assert done["finalised"] == [{"step": 2, "status": "complete", "revision": 1}]
    assert texts == [[PIPELINE.fresh_plain, PIPELINE.finalise_fresh, PIPELINE.insert_values]]
    assert PIPELINE.locked_steps_of in ran  # refused, then stored the general way
    assert client.get("/v1/runs/r/steps/2").json()["metrics"]["a"]["value"] == 4.0
    ran.clear()
    assert _post(client, _body((3, 0, 1.0), (3, 1, 2.0)))["finalised"] == [
        {"step": 3, "status": "complete", "revision": 1}
    ]
    assert client.get("/v1/runs/r/steps/3").json()["metrics"]["a"]["value"] == 3.0


def test_a_step_whose_row_is_not_the_groups_own_is_finalised_the_general_way(
    client: TestClient, texts: list[list[str]], ran: list[str], postgres_url: str
) -> None:
    """A step row there before the group (here put there by hand, as no pair of it is
    stored): the group's counters go onto it, so its row is not the one the group's
    finalisation took; that fails, the transaction with it, and the group is stored
    and its step finalised the general way."""
    _finalise_first_step(client)
    dsn = postgres_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(
            "INSERT INTO steps (run_id, step, status, revision, committed_ranks, expected, "
            "received, missing_ranks, first_seen_at, deadline) "
            "SELECT id, 2, 'open', 0, 0, 0, 0, 2, 1.0, 1e12 FROM runs WHERE name = 'r'"
        )
    texts.clear()
    ran.clear()
    done = _post(client, _body((2, 0, 1.5), (2, 1, 2.5)))
    assert done["finalised"] == [{"step": 2, "status": "complete", "revision": 1}]
    assert texts == [[PIPELINE.fresh_plain, PIPELINE.finalise_fresh, PIPELINE.insert_values]]
    assert PIPELINE.locked_steps_of in ran
    step = client.get("/v1/runs/r/steps/2").json()
    assert (step["status"], step["revision"], step["metrics"]["a"]["value"]) == ("complete", 1, 4.0)
    assert step["first_seen_at"] == "1970-01-01T00:00:01+00:00"  # the row that was there


def test_a_run_with_a_change_rule_finalises_after_the_commit(
    client: TestClient, texts: list[list[str]], ran: list[str]
) -> None:
    """A change rule compares a step with the earlier steps' stored values, which the
    loop does not read: such a run's steps are finalised after the commit, with the
    rule checked."""
    spec = {
        "name": "w",
        "world_size": 2,
        "metrics": {"a": "sum", "n": "count"},
        "alerts": [{"name": "jump", "metric": "a", "change_above": 0.5, "window": 2}],
    }
    assert client.post("/v1/runs", json=spec).status_code == 201
    for step, a in ((0, 1.0), (1, 1.0), (2, 9.0)):
        texts.clear()
        ran.clear()
        body = _body((step, 0, a / 2), (step, 1, a / 2))
        answer = client.post("/v1/runs/w/fragments", content=body, headers=JSON).json()
        assert answer["finalised"] == [{"step": step, "status": "complete", "revision": 1}]
        assert texts and all(PIPELINE.finalise_fresh not in group for group in texts)
    assert PIPELINE.locked_steps_of in ran
    breaches = client.get("/v1/runs/w/steps/2").json()["breaches"]
    assert [b["rule"] for b in breaches] == ["jump"]


def test_a_step_finalised_partial_since_the_loop_stored_its_ranks_is_revised_the_general_way(
    client: TestClient, texts: list[list[str]], ran: list[str]
) -> None:
    """The loop stored rank 0 of step 2; the step timed out and was finalised partial
    (the sweep); rank 1 then completes it: the group's write, which finalises the step
    as the loop knew it, finds it finalised and writes nothing, and the writer threads
    store it and finalise revision 2."""
    _finalise_first_step(client)
    assert _post(client, orjson.dumps(_rank(2, 0)))["finalised"] == []
    store = client.app.state.store  # type: ignore[attr-defined]
    [partial] = store.sweep(now=time.time() + 1e9)
    assert (partial.step, partial.status.value, partial.revision) == (2, "partial", 1)
    texts.clear()
    ran.clear()
    done = _post(client, orjson.dumps(_rank(2, 1)))
    assert done["finalised"] == [{"step": 2, "status": "complete", "revision": 2}]
    # finalised inside as the loop knew the step, refused as it stands: nothing written
    assert texts == [[PIPELINE.fresh_plain, PIPELINE.finalise_fresh, PIPELINE.insert_values]]
    assert PIPELINE.pairs_of in ran  # the writer threads' probe
    step = client.get("/v1/runs/r/steps/2").json()
    assert (step["status"], step["revision"]) == ("complete", 2)
    assert step["metrics"]["a"]["value"] == 0.1 + 0.2


def test_the_loop_forgets_its_oldest_open_steps_first(
    client: TestClient, texts: list[list[str]], ran: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past :data:`.pg_loop.OPEN_PAIRS` pairs the loop forgets its oldest open steps:
    such a step is finalised after its commit, the newer one inside its group."""
    monkeypatch.setattr(pg_loop, "OPEN_PAIRS", 1)
    _finalise_first_step(client)
    for step in (2, 3):
        assert _post(client, orjson.dumps(_rank(step, 0)))["finalised"] == []
    [writer] = client.app.state.store._loop_writers.values()  # type: ignore[attr-defined]
    assert [step for _, step in writer._open_steps] == [3]
    texts.clear()
    ran.clear()
    done = _post(client, orjson.dumps(_rank(2, 1)))
    assert done["finalised"] == [{"step": 2, "status": "complete", "revision": 1}]
    assert texts == [[PIPELINE.fresh_plain]] and PIPELINE.locked_steps_of in ran
    texts.clear()
    ran.clear()
    done = _post(client, orjson.dumps(_rank(3, 1)))
    assert done["finalised"] == [{"step": 3, "status": "complete", "revision": 1}]
    assert texts == [[PIPELINE.fresh_plain, PIPELINE.finalise_fresh, PIPELINE.insert_values]]
    assert ran == [] and writer._open_steps == {} and writer._open_pairs == 0
    assert _step(client, 2) | {"step": 3} == _step(client, 3)
