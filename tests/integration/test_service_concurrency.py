"""Two app instances over one PostgreSQL database finalise each step exactly once."""

from __future__ import annotations

import threading
from typing import Any

import pytest

pytestmark = pytest.mark.postgres


@pytest.fixture
def db_url(postgres_url: str, empty_database: Any) -> str:
    """Only PostgreSQL here: SQLite serialises writers by design."""
    empty_database(postgres_url)
    return postgres_url


def _finalisations(app: Any, status: str) -> float:
    value = app.state.registry.get_sample_value(
        "steptally_steps_finalised_total", {"run": "c", "status": status}
    )
    return value or 0.0


def test_concurrent_completion_finalises_once(make_client: Any, api_of: Any) -> None:
    apps = [make_client(), make_client()]
    apis = [api_of(client) for _, client in apps]
    ranks, steps = 8, 12
    apis[0].register(name="c", world_size=ranks)
    barrier = threading.Barrier(ranks)
    answers: list[Any] = []

    def rank_worker(rank: int) -> None:
        api = apis[rank % 2]
        for step in range(steps):
            barrier.wait()
            frag = [(step, rank, 0, {"a": 1.0 + rank, "n": 1})]
            answers.append(api.send(frag, [(step, rank, 1)], run="c"))

    threads = [threading.Thread(target=rank_worker, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(a.status_code == 200 for a in answers)
    finalised = [f for a in answers for f in a.json()["finalised"]]
    assert sorted(f["step"] for f in finalised) == list(range(steps))
    assert {f["revision"] for f in finalised} == {1}
    assert sum(_finalisations(app, "complete") for app, _ in apps) == steps
    for step in range(steps):
        got = apis[1].step(step, "c")
        assert (got["status"], got["revision"]) == ("complete", 1)
        assert got["metrics"]["a"]["value"] == sum(1.0 + r for r in range(ranks))


def test_concurrent_sweeps_finalise_once(make_client: Any, api_of: Any, clock: Any) -> None:
    apps = [make_client(), make_client()]
    api = api_of(apps[0][1])
    api.register(name="c", world_size=2, step_timeout_s=1)
    for step in range(20):
        api.send([(step, 0, 0, {"a": 1.0})], run="c")
    clock.now += 1
    done: list[Any] = []
    threads = [
        threading.Thread(target=lambda a=app: done.extend(a.state.service.sweep()))
        for app, _ in apps
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(d.step for d in done) == list(range(20))
    assert sum(_finalisations(app, "partial") for app, _ in apps) == 20
