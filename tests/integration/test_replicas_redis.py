"""Two ``steptally serve`` replicas on one PostgreSQL and one Redis: a step finalised
through either appears on both replicas' event streams within 100 ms; with Redis
unreachable, or lost and back, streams degrade to replay from the database."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from steptally.client.read import Client
from steptally.service.usecase.events import POLL_S
from tests.integration.test_events import Stream
from tests.integration.test_read_client import _following, _taken
from tests.support.redis_server import SHARED_REDIS, PrivateRedis
from tests.support.served import ServedService, free_port

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

FANOUT_S = 0.100


@pytest.fixture
def replicas(
    postgres_url: str,
    empty_database: Callable[[str], None],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[[str, str], list[ServedService]]]:
    """``replicas(redis_url, prefix)``: two started replicas on one emptied PostgreSQL."""
    empty_database(postgres_url)
    started: list[ServedService] = []

    def start(redis_url: str, prefix: str) -> list[ServedService]:
        monkeypatch.setenv("STEPTALLY_REDIS_URL", redis_url)
        monkeypatch.setenv("STEPTALLY_REDIS_PREFIX", prefix)
        monkeypatch.setenv("STEPTALLY_SWEEP_INTERVAL_S", "0.1")
        for name in ("a", "b"):
            started.append(ServedService(postgres_url, tmp_path / f"{name}.log", migrate=False))
            started[-1].start()
        return started

    yield start
    for service in started:
        service.stop()


def _register(base: str) -> None:
    spec = {"name": "r", "world_size": 2, "metrics": {"a": "sum", "n": "count"}}
    assert httpx.post(f"{base}/v1/runs", json={**spec, "step_timeout_s": 60}).status_code == 201


def _send(base: str, step: int, rank: int) -> dict[str, Any]:
    body = {
        "fragments": [{"step": step, "rank": rank, "seq": 0, "values": {"a": 1.5, "n": 1}}],
        "commits": [{"step": step, "rank": rank, "fragments": 1}],
    }
    answer = httpx.post(f"{base}/v1/runs/r/fragments", json=body)
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


def _finalise(base: str, step: int) -> float:
    """Complete ``step`` through ``base``; the monotonic time its answer arrived."""
    _send(base, step, 0)
    assert _send(base, step, 1)["finalised"] == [
        {"step": step, "status": "complete", "revision": 1}
    ]
    return time.monotonic()


def _steps(events: list[dict[str, str]]) -> list[int]:
    return [orjson.loads(e["data"])["step"] for e in events]


def test_a_step_finalised_on_one_replica_reaches_the_other_within_100ms(
    replicas: Callable[[str, str], list[ServedService]], redis_prefix: str
) -> None:
    a, b = replicas(SHARED_REDIS, redis_prefix)
    _register(a.url)
    on_a, on_b = Stream(f"{a.url}/v1/runs/r/events"), Stream(f"{b.url}/v1/runs/r/events")
    latencies = []
    try:
        for step in range(10):
            origin = (a, b)[step % 2]  # each replica finalises half the steps
            answered = _finalise(origin.url, step)
            (event,) = on_b.take(1)
            latencies.append(time.monotonic() - answered)
            assert _steps([event]) == [step]
            assert (
                orjson.loads(event["data"]) == httpx.get(f"{b.url}/v1/runs/r/steps/{step}").json()
            )
        assert _steps(on_a.take(10)) == list(range(10))
        assert on_a.nothing_more() and on_b.nothing_more()  # each event once per stream
    finally:
        on_a.close()
        on_b.close()
    assert max(latencies) < FANOUT_S, latencies


def test_redis_unreachable_keeps_ingest_and_every_stream_live_from_the_database(
    replicas: Callable[[str, str], list[ServedService]], redis_prefix: str
) -> None:
    a, b = replicas(f"redis://127.0.0.1:{free_port()}/0", redis_prefix)
    _register(a.url)
    on_a, on_b = Stream(f"{a.url}/v1/runs/r/events"), Stream(f"{b.url}/v1/runs/r/events")
    try:
        answered = _finalise(a.url, 0)
        assert _steps(on_a.take(1)) == [0]  # its own finalisation wakes its stream
        assert _steps(on_b.take(1)) == [0]  # the other replica's, by its next poll
        assert time.monotonic() - answered < POLL_S + 1.0
        _finalise(b.url, 1)
        assert _steps(on_a.take(1)) == [1] and _steps(on_b.take(1)) == [1]
        assert on_a.nothing_more() and on_b.nothing_more()  # each once
    finally:
        on_a.close()
        on_b.close()
    assert httpx.get(f"{b.url}/v1/runs/r/steps/0").json()["status"] == "complete"
    assert httpx.get(f"{b.url}/readyz").status_code == 200


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


def _live_again(a: ServedService, b: ServedService, first_step: int) -> int:
    """Finalise steps through ``a`` until a fresh stream on ``b`` hears one live (the
    replicas subscribed again); the next free step."""
    step = first_step
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        probe = Stream(f"{b.url}/v1/runs/r/events")
        try:
            _finalise(a.url, step)
            step += 1
            if not probe.nothing_more(0.3):
                return step
        finally:
            probe.close()
    pytest.fail("the replicas never heard each other again")


def test_redis_lost_and_back_streams_end_and_replay_what_they_missed(
    replicas: Callable[[str, str], list[ServedService]], private_redis: PrivateRedis
) -> None:
    a, b = replicas(private_redis.url, "steptally")
    _register(a.url)
    on_b = Stream(f"{b.url}/v1/runs/r/events")
    _finalise(a.url, 0)
    (seen,) = on_b.take(1)
    private_redis.stop()
    assert on_b.ended.wait(10)  # the subscription is lost: the stream ends cleanly
    _finalise(a.url, 1)  # while Redis is away
    private_redis.start()
    next_step = _live_again(a, b, 2)
    again = Stream(f"{b.url}/v1/runs/r/events", headers={"Last-Event-ID": seen["id"]})
    try:
        assert _steps(again.take(next_step - 1)) == list(range(1, next_step))
        answered = _finalise(a.url, next_step)
        assert _steps(again.take(1, timeout=FANOUT_S * 10)) == [next_step]
        assert time.monotonic() - answered < FANOUT_S
        assert again.nothing_more()
    finally:
        again.close()
        on_b.close()


def test_a_follower_through_a_redis_restart_receives_every_step_once(
    replicas: Callable[[str, str], list[ServedService]], private_redis: PrivateRedis
) -> None:
    """The case of a live page that missed every step: the stream on one replica ends
    when Redis goes away, before its client received any event, and both replicas go on
    finalising steps while Redis is away and after it is back."""
    a, b = replicas(private_redis.url, "steptally")
    _register(a.url)
    with Client(b.url) as client:
        steps, follower = _following(client, "r")
        private_redis.stop()
        deadline = time.monotonic() + 15
        while follower.reconnects < 1:  # the stream ended, and opened again without Redis
            assert time.monotonic() < deadline, "the stream did not end when Redis went away"
            time.sleep(0.05)
        for step in range(4):  # while Redis is away, on either replica
            _finalise((a, b)[step % 2].url, step)
        private_redis.start()
        time.sleep(1.0)  # the replicas subscribe again
        for step in range(4, 8):
            _finalise((a, b)[step % 2].url, step)
        assert sorted(_taken(steps, 8)) == list(range(8))
        with pytest.raises(queue.Empty):
            steps.get(timeout=1.5)  # none twice
        assert follower.reconnects >= 1


@pytest.mark.browser
def test_a_browser_event_source_through_a_redis_restart_receives_every_step_once(
    replicas: Callable[[str, str], list[ServedService]],
    private_redis: PrivateRedis,
    browser: Any,
) -> None:
    """The same with a real ``EventSource`` in headless Chromium: it keeps the id of the
    stream's first message (no data) and reconnects with it by itself."""
    a, b = replicas(private_redis.url, "steptally")
    _register(a.url)
    page = browser.new_page()
    try:
        page.goto(f"{b.url}/healthz")  # any page of the replica: same origin
        page.evaluate(
            """() => {
              window.steps = []; window.opens = 0;
              const source = new EventSource("/v1/runs/r/events");
              source.onopen = () => { window.opens += 1; };
              source.addEventListener(
                "step", (e) => window.steps.push(JSON.parse(e.data).step)
              );
            }"""
        )
        page.wait_for_function("window.opens >= 1")
        private_redis.stop()
        page.wait_for_function("window.opens >= 2", timeout=15_000)  # it reconnected
        for step in range(4):
            _finalise((a, b)[step % 2].url, step)
        private_redis.start()
        time.sleep(1.0)
        for step in range(4, 8):
            _finalise((a, b)[step % 2].url, step)
        page.wait_for_function("window.steps.length >= 8", timeout=20_000)
        time.sleep(1.5)  # and nothing more
        steps = page.evaluate("window.steps")
    finally:
        page.close()
    assert sorted(steps) == list(range(8)), steps


def test_replicas_racing_to_finalise_breach_once_per_step_and_rule(
    replicas: Callable[[str, str], list[ServedService]],
) -> None:
    """Both replicas sweep the same timed-out steps every 0.1 s and take batches for the
    same steps: each (step, rule) breaches once, and both export the same count."""
    a, b = replicas(SHARED_REDIS, f"steptally-test-{free_port()}:")
    rules = [
        {"name": "ranks", "missing_ranks_above": 0},
        {"name": "hot", "metric": "a", "above": 1},
    ]
    spec = {"name": "r", "world_size": 2, "metrics": {"a": "sum", "n": "count"}, "alerts": rules}
    assert httpx.post(f"{a.url}/v1/runs", json={**spec, "step_timeout_s": 0.5}).status_code == 201
    steps = range(20)
    for step in steps:  # rank 0 only, through both replicas: every step times out partial
        _send((a, b)[step % 2].url, step, 0)
    deadline = time.monotonic() + 30
    listed: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        listed = httpx.get(f"{b.url}/v1/runs/r/breaches", params={"limit": 1000}).json()["breaches"]
        if len(listed) == 2 * len(steps):
            break
        time.sleep(0.2)
    assert [(x["step"], x["rule"]) for x in listed] == [
        (s, rule) for s in steps for rule in ("hot", "ranks")
    ]
    for step in steps:  # rank 1 late: revision 2 still breaches "hot", no longer "ranks"
        _send((b, a)[step % 2].url, step, 1)
    shown = httpx.get(f"{a.url}/v1/runs/r/steps", params={"limit": 100}).json()["steps"]
    assert {(s["revision"], tuple(x["rule"] for x in s["breaches"])) for s in shown} == {
        (2, ("hot",))
    }
    for replica in (a, b):
        text = httpx.get(f"{replica.url}/metrics").text
        for rule in ("hot", "ranks"):
            assert f'steptally_alert_breaches_total{{rule="{rule}",run="r"}} 20.0' in text
