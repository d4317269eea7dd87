"""``steptally serve --workers N``: N processes serve one database, and the steps they
share are finalised once with the exact values."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
from support.served import ServedService

from tests.integration.test_events import Stream


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_two_workers_serve_and_share_steps(
    db_url: str, serve: Callable[..., ServedService]
) -> None:
    service = serve(db_url, "--workers", "2")
    assert service.proc is not None
    spec = {"name": "w", "world_size": 2, "metrics": {"a": "sum", "n": "count"}}
    try:
        assert len(_children(service.proc.pid)) >= 2  # the workers (and uvicorn's helpers)
        with httpx.Client(base_url=service.url, timeout=10) as http:
            assert http.post("/v1/runs", json=spec).status_code in (200, 201)
            for rank, seq, value in ((0, 0, 1e17), (1, 0, 3.0), (0, 1, -1e17)):
                fragment = {"step": 0, "rank": rank, "seq": seq, "values": {"a": value, "n": 1}}
                answer = http.post("/v1/runs/w/fragments", json={"fragments": [fragment]})
                assert answer.status_code == 200, answer.text
            commits = [
                {"step": 0, "rank": 0, "fragments": 2},
                {"step": 0, "rank": 1, "fragments": 1},
            ]
            answer = http.post("/v1/runs/w/fragments", json={"commits": commits})
            assert answer.status_code == 200, answer.text
            answer = answer.json()
            assert answer["finalised"] == [{"step": 0, "status": "complete", "revision": 1}]
            step = http.get("/v1/runs/w/steps/0").json()
    finally:
        service.stop(signal.SIGTERM)  # the parent stops its workers
    assert step["status"] == "complete"
    assert step["metrics"]["a"]["value"] == 3.0  # exact: adding in order gives 0.0
    assert step["metrics"]["n"]["value"] == 3


def test_a_stream_on_one_worker_sends_every_workers_finalisations_once(
    db_url: str, serve: Callable[..., ServedService]
) -> None:
    """Without Redis no worker hears the others: their streams read the database, so
    the steps another worker finalises arrive live, in order, once."""
    service = serve(db_url, "--workers", "2")
    spec = {"name": "w", "world_size": 1, "metrics": {"a": "sum"}}
    try:
        assert httpx.post(f"{service.url}/v1/runs", json=spec).status_code in (200, 201)
        stream = Stream(f"{service.url}/v1/runs/w/events")
        try:
            for step in range(12):  # a new connection each: either worker answers
                body = {
                    "fragments": [{"step": step, "rank": 0, "seq": 0, "values": {"a": 1.0}}],
                    "commits": [{"step": step, "rank": 0, "fragments": 1}],
                }
                assert httpx.post(f"{service.url}/v1/runs/w/fragments", json=body).is_success
            got = [orjson.loads(e["data"])["step"] for e in stream.take(12)]
            assert stream.nothing_more(1.0)
        finally:
            stream.close()
    finally:
        service.stop(signal.SIGTERM)
    assert got == list(range(12))
