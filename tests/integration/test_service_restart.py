"""Restart: a new app over the same database, and ``kill -9`` of a real server."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.served import ServedService

Api = Any  # the `api` fixture of conftest.py


def test_second_app_over_same_database_answers_identically(
    api: Api, make_client: Any, api_of: Any
) -> None:
    api.register(world_size=2, derived={"mean": "a / n"})
    api.send([(0, 0, 0, {"a": 1e17, "n": 1}), (0, 1, 0, {"a": 1.0, "n": 2})], [(0, 0, 1)])
    api.send([(1, 0, 0, {"a": 0.1, "n": 3})], [(1, 0, 1), (1, 1, 0)])
    before = [api.step(0), api.step(1), api.client.get("/v1/runs").json()]
    _, other_client = make_client()
    other = api_of(other_client)
    assert [other.step(0), other.step(1), other.client.get("/v1/runs").json()] == before
    other.send([(0, 1, 1, {"a": -1e17, "n": 1})], [(0, 1, 2)])
    assert api.value(0, "a") == 1.0
    assert api.value(0, "mean") == 0.25


@pytest.mark.slow
def test_kill_9_loses_nothing_acknowledged(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'served.sqlite3'}"
    refused = ServedService.cli("serve", "--database-url", url, check=False)
    assert refused.returncode != 0
    assert b"steptally migrate" in refused.stderr
    service = ServedService(url, tmp_path / "serve.log").start()
    base = f"{service.url}/v1/runs"
    try:
        spec = {
            "name": "k",
            "world_size": 3,
            "metrics": {"a": "sum", "n": "count"},
            "derived": {"mean": "a / n"},
        }
        assert httpx.post(base, json=spec).status_code == 201
        for rank, a in enumerate([1e17, 1.0]):
            body = {
                "fragments": [
                    {"step": 0, "rank": rank, "seq": 0, "values": {"a": a, "n": rank + 1}}
                ],
                "commits": [{"step": 0, "rank": rank, "fragments": 1}],
            }
            assert httpx.post(f"{base}/k/fragments", json=body).status_code == 200
    finally:
        service.stop(signal.SIGKILL)
    service.start()
    try:
        body = {
            "fragments": [{"step": 0, "rank": 2, "seq": 0, "values": {"a": -1e17, "n": 1}}],
            "commits": [{"step": 0, "rank": 2, "fragments": 1}],
        }
        answer = httpx.post(f"{base}/k/fragments", json=body).json()
        assert answer["finalised"] == [{"step": 0, "status": "complete", "revision": 1}]
        step = httpx.get(f"{base}/k/steps/0").json()
        assert step["metrics"]["a"]["value"] == 1.0
        assert step["metrics"]["mean"]["value"] == 0.25
        assert step["fragments"] == {"received": 3, "expected": 3}
    finally:
        service.stop()
