"""Open steps' commit progress in Redis (``STEPTALLY_REDIS_URL``): which ranks committed
and what each declared, recorded after each committed ingest and read instead of the
database's commits when it agrees with the step row; rebuilt after a wipe, ignored
while Redis is away, deleted when the step is finalised, and never part of a
finalised result."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi import FastAPI

from steptally.service.coordination import store as coordinated
from steptally.service.coordination.keys import RedisKeys
from steptally.service.coordination.progress import ProgressBoard, run_key
from steptally.service.domain.run import RunRecord
from steptally.service.usecase.query import step_json
from tests.integration.conftest import Api, AppFactory, Clock, _empty
from tests.support.redis_server import SHARED_REDIS, PrivateRedis, delete_prefix

pytestmark = pytest.mark.redis

TIMEOUT_S = 10.0
WORLD = 4


@pytest.fixture
def fallbacks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The steps whose commits a read took from the database, not from Redis."""
    seen: list[int] = []
    original = coordinated.step_live

    def counted(engine: Any, run: RunRecord, step: int) -> Any:
        seen.append(step)
        return original(engine, run, step)

    monkeypatch.setattr(coordinated, "step_live", counted)
    return seen


def _started(make_client: AppFactory, url: str, redis_prefix: str) -> tuple[FastAPI, Api]:
    app, client = make_client(redis_url=url, redis_prefix=redis_prefix)
    api = Api(client)
    assert api.register(world_size=WORLD, step_timeout_s=TIMEOUT_S).status_code in (200, 201)
    return app, api


def _run(app: FastAPI) -> RunRecord:
    run: RunRecord = app.state.service.runs.get("r")
    return run


def _send(api: Api, step: int, rank: int, seqs: range, commit: int | None = None) -> Any:
    fragments = [(step, rank, q, {"a": 0.25 * (rank + 1) + q, "n": 1}) for q in seqs]
    commits = [] if commit is None else [(step, rank, commit)]
    answer = api.send(fragments, commits)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _database_view(app: FastAPI, step: int) -> dict[str, Any]:
    """The step as the SQL store alone reads it (commits from the database)."""
    run = _run(app)
    record = app.state.store.sql.get_step(run, step)
    assert record is not None
    return step_json(run, record)


def _run_key(app: FastAPI) -> str:
    """How the progress keys name the run (its id and registration time)."""
    run = _run(app)
    return run_key(run.id, run.created_at)


def _held(client: redis.Redis, redis_prefix: str, run_id: str, step: int) -> dict[int, int]:
    return ProgressBoard(client, RedisKeys(redis_prefix)).read(run_id, [step])[step]


def _keys(client: redis.Redis, redis_prefix: str, run_id: str, step: int) -> int:
    keys = RedisKeys(redis_prefix)
    return int(
        client.exists(keys.progress_ranks(run_id, step), keys.progress_declared(run_id, step))
    )


def _mixed_ingest(a: Api, b: Api) -> None:
    """Step 0: ranks 0 and 1 commit through replica a, rank 2 through b (with a retry
    of rank 0's body there), rank 3 sends a fragment only. Step 1: fragments, no commit.
    Step 2: every rank commits, through either replica: complete."""
    _send(a, 0, 0, range(3), commit=3)
    _send(a, 0, 1, range(2))
    _send(b, 0, 1, range(0), commit=2)  # a commit alone, the fragments came before
    _send(b, 0, 2, range(1), commit=1)
    assert _send(b, 0, 0, range(3), commit=3)["duplicates"] == 3  # a retry elsewhere
    _send(a, 0, 3, range(1))
    _send(b, 1, 2, range(2))
    for rank in range(WORLD):
        _send(a if rank % 2 else b, 2, rank, range(2), commit=2)


def test_progress_matches_the_database_after_a_mixed_ingest_across_two_replicas(
    make_client: AppFactory, redis_prefix: str, shared_redis: redis.Redis, fallbacks: list[int]
) -> None:
    app_a, a = _started(make_client, SHARED_REDIS, redis_prefix)
    app_b, b = _started(make_client, SHARED_REDIS, redis_prefix)
    _mixed_ingest(a, b)
    run_id = _run_key(app_a)
    assert _held(shared_redis, redis_prefix, run_id, 0) == {0: 3, 1: 2, 2: 1}
    raw = shared_redis.get(RedisKeys(redis_prefix).progress_ranks(run_id, 0))
    assert raw == b"\xe0"  # bits 0, 1 and 2: one byte for the three ranks
    assert _held(shared_redis, redis_prefix, run_id, 1) == {}
    assert _keys(shared_redis, redis_prefix, run_id, 1) == 0  # fragments alone write nothing
    assert _keys(shared_redis, redis_prefix, run_id, 2) == 0  # completed: its keys are gone
    for api in (a, b):
        for step in (0, 1):
            body = api.step(step)
            assert body == _database_view(app_a, step)
    body = a.step(0)
    assert (body["status"], body["ranks_committed"], body["ranks_missing"]) == (
        "open",
        [0, 1, 2],
        [3],
    )
    assert body["fragments"] == {"received": 7, "expected": None}
    assert body["missing_fragments"] == {}
    assert body["metrics"]["a"]["value"] == 0.25 + 1.25 + 2.25 + 0.5 + 1.5 + 0.75 + 1.0
    assert fallbacks == []  # every open step was read with its commits from Redis
    page = b.client.get("/v1/runs/r/steps").json()["steps"]
    assert page == [_database_view(app_b, s) for s in range(3)]
    assert [s["status"] for s in page] == ["open", "open", "complete"]
    assert fallbacks == []


def test_a_wiped_redis_is_read_around_then_rebuilt_from_the_database(
    make_client: AppFactory, redis_prefix: str, shared_redis: redis.Redis, fallbacks: list[int]
) -> None:
    app, api = _started(make_client, SHARED_REDIS, redis_prefix)
    assert app.state.service.sweep() == []  # builds the (empty) schedule
    _send(api, 0, 0, range(2), commit=2)
    _send(api, 0, 1, range(1), commit=1)
    run_id = _run_key(app)
    delete_prefix(SHARED_REDIS, redis_prefix)  # the wipe
    assert api.step(0) == _database_view(app, 0)
    assert fallbacks == [0]  # nothing in Redis, the row says two commits
    _send(api, 0, 2, range(1), commit=1)  # Redis now holds rank 2 alone
    assert _held(shared_redis, redis_prefix, run_id, 0) == {2: 1}
    body = api.step(0)
    assert body == _database_view(app, 0)
    assert (body["ranks_committed"], body["ranks_missing"]) == ([0, 1, 2], [3])
    assert fallbacks == [0, 0]
    assert app.state.service.sweep() == []  # the built marker is gone: rebuild
    assert _held(shared_redis, redis_prefix, run_id, 0) == {0: 2, 1: 1, 2: 1}
    assert api.step(0) == _database_view(app, 0)
    assert fallbacks == [0, 0]  # Redis agrees again


def test_a_wrong_value_in_redis_is_never_shown_nor_finalised(
    make_client: AppFactory, redis_prefix: str, shared_redis: redis.Redis, fallbacks: list[int]
) -> None:
    app, api = _started(make_client, SHARED_REDIS, redis_prefix)
    _send(api, 0, 0, range(1), commit=1)
    run_id = _run_key(app)
    keys = RedisKeys(redis_prefix)
    shared_redis.setbit(keys.progress_ranks(run_id, 0), 3, 1)  # a rank that never committed
    body = api.step(0)
    assert body == _database_view(app, 0)
    assert body["ranks_committed"] == [0]
    assert fallbacks == [0]
    for rank in (1, 2, 3):
        _send(api, 0, rank, range(1), commit=1)
    body = api.step(0)
    assert (body["status"], body["revision"], body["ranks_committed"]) == (
        "complete",
        1,
        [0, 1, 2, 3],
    )
    assert body["metrics"]["a"]["value"] == 0.25 + 0.5 + 0.75 + 1.0
    assert body["metrics"]["n"]["value"] == 4
    assert _keys(shared_redis, redis_prefix, run_id, 0) == 0


def test_a_replica_whose_write_was_lost_is_read_around_until_its_sweep_rebuilds(
    make_client: AppFactory,
    redis_prefix: str,
    shared_redis: redis.Redis,
    fallbacks: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app_a, a = _started(make_client, SHARED_REDIS, redis_prefix)
    app_b, b = _started(make_client, SHARED_REDIS, redis_prefix)
    assert app_a.state.service.sweep() == []
    _send(b, 0, 0, range(1), commit=1)

    def lost(*_: Any) -> None:  # as if replica a died between its commit and its write
        raise redis.ConnectionError("lost")

    with monkeypatch.context() as patch:
        patch.setattr(app_a.state.store.progress, "record", lost)
        _send(a, 0, 1, range(2), commit=2)  # acknowledged: it is in the database
    _send(b, 0, 2, range(1), commit=1)
    run_id = _run_key(app_b)
    assert _held(shared_redis, redis_prefix, run_id, 0) == {0: 1, 2: 1}
    body = b.step(0)
    assert body == _database_view(app_b, 0)
    assert (body["ranks_committed"], body["ranks_missing"]) == ([0, 1, 2], [3])
    assert fallbacks == [0]
    assert app_a.state.service.sweep() == []  # a talks to Redis again: it rebuilds first
    assert _held(shared_redis, redis_prefix, run_id, 0) == {0: 1, 1: 2, 2: 1}
    assert b.step(0) == body
    assert fallbacks == [0]


def test_a_recreated_database_never_reads_an_earlier_ones_progress(
    make_client: AppFactory,
    db_url: str,
    clock: Clock,
    redis_prefix: str,
    shared_redis: redis.Redis,
    fallbacks: list[int],
) -> None:
    app, api = _started(make_client, SHARED_REDIS, redis_prefix)
    _send(api, 0, 0, range(1), commit=1)
    earlier = _run(app)
    _empty(db_url)  # the database recreated; Redis keeps the earlier keys
    clock.now += 1
    app, api = _started(make_client, SHARED_REDIS, redis_prefix)
    assert _run(app).id == earlier.id  # the same run id, registered anew
    _send(api, 0, 1, range(1), commit=1)
    assert _held(shared_redis, redis_prefix, run_key(earlier.id, earlier.created_at), 0) == {0: 1}
    assert _held(shared_redis, redis_prefix, _run_key(app), 0) == {1: 1}
    body = api.step(0)
    assert (body["ranks_committed"], body["ranks_missing"]) == ([1], [0, 2, 3])
    assert body == _database_view(app, 0)
    assert fallbacks == []


def test_redis_away_steps_are_read_from_the_database(
    make_client: AppFactory, clock: Clock, tmp_path: Path, fallbacks: list[int]
) -> None:
    server = PrivateRedis(tmp_path)
    server.start()
    try:
        app, api = _started(make_client, server.url, "steptally")
        assert app.state.service.sweep() == []
        _send(api, 0, 0, range(2), commit=2)
        _send(api, 1, 1, range(1), commit=1)
        before = [api.step(s) for s in (0, 1)]
        assert fallbacks == []
        server.stop(signal.SIGKILL)
        started = time.perf_counter()
        assert [api.step(s) for s in (0, 1)] == before
        answer = api.client.get("/v1/runs/r/steps")
        assert answer.status_code == 200, answer.text
        assert answer.json()["steps"] == before
        _send(api, 0, 2, range(1), commit=1)  # acknowledged while Redis is away
        assert api.step(0)["ranks_committed"] == [0, 2]
        assert time.perf_counter() - started < 3.0  # one timeout at most, then no waits
        server.start()  # back, empty: the next sweep rebuilds what it lost
        assert app.state.service.sweep() == []
        with server.client() as client:
            assert _held(client, "steptally", _run_key(app), 0) == {0: 2, 2: 1}
        fallbacks.clear()
        assert api.step(0) == _database_view(app, 0)
        assert fallbacks == []
    finally:
        server.stop(signal.SIGKILL)


def test_finalised_steps_leave_no_keys(
    make_client: AppFactory, clock: Clock, redis_prefix: str, shared_redis: redis.Redis
) -> None:
    app, api = _started(make_client, SHARED_REDIS, redis_prefix)
    assert app.state.service.sweep() == []
    for step in range(3):
        _send(api, step, 0, range(1), commit=1)
    run_id = _run_key(app)
    assert [_keys(shared_redis, redis_prefix, run_id, s) for s in range(3)] == [2, 2, 2]
    for rank in range(1, WORLD):
        _send(api, 1, rank, range(1), commit=1)  # completes step 1
    assert [_keys(shared_redis, redis_prefix, run_id, s) for s in range(3)] == [2, 0, 2]
    clock.now += TIMEOUT_S + 1
    done = app.state.service.sweep()
    assert sorted((f.step, f.status.value) for f in done) == [(0, "partial"), (2, "partial")]
    assert [_keys(shared_redis, redis_prefix, run_id, s) for s in range(3)] == [0, 0, 0]
    ttl = shared_redis.ttl(RedisKeys(redis_prefix).progress_ranks(run_id, 5))
    assert ttl == -2  # never written
    _send(api, 5, 0, range(1), commit=1)
    ttl = shared_redis.ttl(RedisKeys(redis_prefix).progress_ranks(run_id, 5))
    assert TIMEOUT_S + 3600 - 5 <= ttl <= TIMEOUT_S + 3600
