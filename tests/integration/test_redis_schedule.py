"""Open steps scheduled in Redis (``STEPTALLY_REDIS_URL``): timing out reads the due
members only, replicas claim each step once, and a wiped, restarted or unreachable
Redis loses nothing — the database's open steps are the source of the schedule."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi import FastAPI

from steptally.service.coordination.keys import RedisKeys
from steptally.service.coordination.schedule import DeadlineSchedule, Due
from steptally.service.store.protocol import FinalisedStep
from tests.integration.conftest import Api, AppFactory, Clock
from tests.support.redis_server import SHARED_REDIS, PrivateRedis, delete_prefix
from tests.support.served import free_port

pytestmark = pytest.mark.redis

TIMEOUT_S = 10.0


def _scheduled(client: redis.Redis, redis_prefix: str) -> dict[str, float]:
    rows = client.zrange(RedisKeys(redis_prefix).deadlines, 0, -1, withscores=True)
    return {raw.decode(): score for raw, score in rows}


def _open_steps(api: Api, steps: range, rank: int = 0) -> None:
    """Rank ``rank`` (of 2) commits each step: every step stays open for the other."""
    for step in steps:
        answer = api.send([(step, rank, 0, {"a": 1.5, "n": 1})], [(step, rank, 1)])
        assert answer.status_code == 200, answer.text


def _sweep(app: FastAPI) -> list[FinalisedStep]:
    done: list[FinalisedStep] = app.state.service.sweep()
    return done


def _run_id(app: FastAPI) -> int:
    run_id: int = app.state.service.runs.get("r").id
    return run_id


def _started(make_client: AppFactory, url: str, redis_prefix: str) -> tuple[FastAPI, Api]:
    app, client = make_client(redis_url=url, redis_prefix=redis_prefix)
    api = Api(client)
    assert api.register(step_timeout_s=TIMEOUT_S).status_code in (200, 201)
    return app, api


def test_open_steps_are_scheduled_and_timed_out_from_redis(
    make_client: AppFactory, clock: Clock, redis_prefix: str, shared_redis: redis.Redis
) -> None:
    app, api = _started(make_client, SHARED_REDIS, redis_prefix)
    assert _sweep(app) == []  # builds the (empty) schedule
    _open_steps(api, range(5))
    run_id = _run_id(app)
    deadline = clock.now + TIMEOUT_S
    assert _scheduled(shared_redis, redis_prefix) == {f"{run_id}:{s}": deadline for s in range(5)}
    # a later arrival keeps the first deadline (the database's)
    clock.now += 1
    _open_steps(api, range(2), rank=0)
    assert _scheduled(shared_redis, redis_prefix)[f"{run_id}:0"] == deadline
    # a completed step leaves the schedule
    answer = api.send([(4, 1, 0, {"a": 2.5, "n": 1})], [(4, 1, 1)])
    assert answer.json()["finalised"] == [{"step": 4, "status": "complete", "revision": 1}]
    assert f"{run_id}:4" not in _scheduled(shared_redis, redis_prefix)
    # the sweeper reads the schedule, not the table: a step taken out of it waits
    shared_redis.zrem(RedisKeys(redis_prefix).deadlines, f"{run_id}:3")
    clock.now = deadline + 1
    assert sorted((f.step, f.status.value, f.revision) for f in _sweep(app)) == [
        (0, "partial", 1),
        (1, "partial", 1),
        (2, "partial", 1),
    ]
    assert api.step(3)["status"] == "open"
    assert _scheduled(shared_redis, redis_prefix) == {}
    # until the schedule is rebuilt from the database (as after a wipe)
    shared_redis.delete(RedisKeys(redis_prefix).deadlines_built)
    assert [(f.step, f.status.value) for f in _sweep(app)] == [(3, "partial")]
    for step in range(4):
        body = api.step(step)
        assert (body["status"], body["revision"], body["ranks_missing"]) == ("partial", 1, [1])
        assert body["metrics"]["a"]["value"] == 1.5
    assert api.step(4)["metrics"]["a"]["value"] == 4.0


def test_a_wiped_redis_is_rebuilt_from_the_database(
    make_client: AppFactory, clock: Clock, redis_prefix: str, shared_redis: redis.Redis
) -> None:
    app, api = _started(make_client, SHARED_REDIS, redis_prefix)
    _open_steps(api, range(6))
    clock.now += TIMEOUT_S / 2
    _open_steps(api, range(6, 9))  # due later than the first six
    run_id = _run_id(app)
    before = _scheduled(shared_redis, redis_prefix)
    assert len(before) == 9
    delete_prefix(SHARED_REDIS, redis_prefix)  # the wipe
    clock.now += TIMEOUT_S / 2 + 0.5  # the first six are due
    assert sorted(f.step for f in _sweep(app)) == list(range(6))
    after = _scheduled(shared_redis, redis_prefix)
    assert after == {m: d for m, d in before.items() if int(m.split(":")[1]) >= 6}
    assert after == {f"{run_id}:{s}": clock.now - 0.5 + TIMEOUT_S / 2 for s in range(6, 9)}
    clock.now += TIMEOUT_S
    assert sorted(f.step for f in _sweep(app)) == [6, 7, 8]
    assert _sweep(app) == []
    assert [api.step(s)["revision"] for s in range(9)] == [1] * 9


def test_replicas_sweeping_together_finalise_each_step_once(
    make_client: AppFactory, clock: Clock, redis_prefix: str
) -> None:
    replicas = [_started(make_client, SHARED_REDIS, redis_prefix) for _ in range(3)]
    api = replicas[0][1]
    _open_steps(api, range(60))
    clock.now += TIMEOUT_S + 1
    finalised: list[FinalisedStep] = []
    barrier = threading.Barrier(len(replicas))

    def sweep(replica: FastAPI) -> None:
        barrier.wait()
        while done := replica.state.service.sweep():
            finalised.extend(done)

    threads = [threading.Thread(target=sweep, args=(a,)) for a, _ in replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(f.step for f in finalised) == list(range(60))
    assert {(f.status.value, f.revision) for f in finalised} == {("partial", 1)}
    steps = api.client.get("/v1/runs/r/steps", params={"limit": 100}).json()["steps"]
    assert [(s["status"], s["revision"]) for s in steps] == [("partial", 1)] * 60


def test_a_claimed_step_is_left_to_its_claimant(
    redis_prefix: str, shared_redis: redis.Redis
) -> None:
    schedule = DeadlineSchedule(redis.Redis.from_url(SHARED_REDIS), RedisKeys(redis_prefix))
    other = DeadlineSchedule(redis.Redis.from_url(SHARED_REDIS), RedisKeys(redis_prefix))
    try:
        due = Due(7, 3, 1.0)
        token = schedule.claim(due)
        assert token is not None and other.claim(due) is None
        other.release(due, "1:not-the-holder")  # only the holder's token releases it
        assert other.claim(due) is None
        schedule.release(due, token)
        second = other.claim(due)
        assert second is not None and int(second.split(":")[0]) > int(token.split(":")[0])
    finally:
        schedule.close()
        other.close()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path, aof=True)
    server.start()
    yield server
    server.stop(signal.SIGKILL)


def test_redis_killed_and_restarted_with_its_append_only_file_loses_nothing(
    make_client: AppFactory, clock: Clock, own_redis: PrivateRedis
) -> None:
    app, api = _started(make_client, own_redis.url, "steptally")
    _sweep(app)
    _open_steps(api, range(4))
    with own_redis.client() as client:
        before = _scheduled(client, "steptally")
    own_redis.stop(signal.SIGKILL)
    own_redis.start()
    run_id = _run_id(app)
    with own_redis.client() as client:
        assert _scheduled(client, "steptally") == before
        assert client.exists(RedisKeys("steptally").deadlines_built)
        # as if the last write had not reached the file (appendfsync everysec)
        client.zrem(RedisKeys("steptally").deadlines, f"{run_id}:3")
    clock.now += TIMEOUT_S + 1
    # a new server run_id: the schedule is rebuilt from the database first
    assert sorted(f.step for f in _sweep(app)) == [0, 1, 2, 3]


def test_redis_away_ingest_goes_on_and_steps_time_out_from_the_database(
    make_client: AppFactory, clock: Clock, own_redis: PrivateRedis
) -> None:
    app, api = _started(make_client, own_redis.url, "steptally")
    _sweep(app)
    _open_steps(api, range(2))
    own_redis.stop(signal.SIGKILL)
    started = time.perf_counter()
    _open_steps(api, range(2, 6))  # acknowledged while Redis is away
    assert time.perf_counter() - started < 2.0
    clock.now += TIMEOUT_S + 1
    assert sorted(f.step for f in _sweep(app)) == list(range(6))  # from the table
    _open_steps(api, range(6, 8))  # Redis still away
    own_redis.start()  # back, with its file: the steps opened meanwhile are not in it
    clock.now += TIMEOUT_S + 1
    assert sorted(f.step for f in _sweep(app)) == [6, 7]
    assert _sweep(app) == []
    assert [api.step(s)["status"] for s in range(8)] == ["partial"] * 8


def test_redis_never_reachable_is_not_an_error(make_client: AppFactory, clock: Clock) -> None:
    app, api = _started(make_client, f"redis://127.0.0.1:{free_port()}/0", "steptally")
    _open_steps(api, range(3))
    assert api.client.get("/readyz").status_code == 200
    clock.now += TIMEOUT_S + 1
    assert sorted(f.step for f in _sweep(app)) == [0, 1, 2]
