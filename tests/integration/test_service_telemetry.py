"""The service's own metrics, on the app's own registry, with exact values."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from steptally.service.api.instrument import RequestMetrics
from steptally.service.metrics.instruments import Telemetry

Api = Any  # the `api` fixture of conftest.py


def _sample(app: Any, name: str, **labels: str) -> float:
    return app.state.registry.get_sample_value(name, labels) or 0.0


def test_ingest_counters(api: Api, app: Any, clock: Any) -> None:
    api.register(world_size=2, step_timeout_s=5)
    api.send([(0, 0, 0, {"a": 1.0}), (0, 0, 1, {"a": 1.0})], [(0, 0, 2)])
    api.send([(0, 0, 0, {"a": 1.0})])
    api.send([(0, 0, 0, {"a": 9.0})])
    api.send([(0, 7, 0, {"a": 9.0})])
    api.send([(0, 1, 0, {"a": 1.0})], [(0, 1, 1)])
    api.send([(1, 1, 0, {"a": 1.0})])
    clock.now += 5
    app.state.service.sweep()
    assert _sample(app, "steptally_fragments_accepted_total", run="r") == 4
    assert _sample(app, "steptally_fragments_duplicate_total", run="r") == 1
    assert _sample(app, "steptally_commits_total", run="r") == 2
    assert _sample(app, "steptally_batches_total") == 4
    assert _sample(app, "steptally_requests_rejected_total", code="fragment_conflict") == 1
    assert _sample(app, "steptally_requests_rejected_total", code="rank_out_of_range") == 1
    # the fragments those two batches carried, refused whole
    rejected = "steptally_fragments_rejected_total"
    assert _sample(app, rejected, run="r", code="fragment_conflict") == 1
    assert _sample(app, rejected, run="r", code="rank_out_of_range") == 1
    assert _sample(app, "steptally_steps_finalised_total", run="r", status="complete") == 1
    assert _sample(app, "steptally_steps_finalised_total", run="r", status="partial") == 1
    assert _sample(app, "steptally_finalise_seconds_count") == 2


def test_exposition_snapshot(api: Api, app: Any, clock: Any) -> None:
    api.register(world_size=2, step_timeout_s=5, derived={"mean": "a / n"})
    api.send(
        [(0, 0, 0, {"a": 3.0, "n": 2}), (0, 1, 0, {"a": "NaN", "n": 1})], [(0, 0, 1), (0, 1, 1)]
    )
    api.send([(1, 0, 0, {"a": 1.0})])
    api.send([(2, 0, 0, {"a": 1.0})])
    clock.now += 5
    api.send([(3, 0, 0, {"a": 1.0})])
    app.state.service.sweep()
    (snap,) = app.state.store.exposition_snapshot()
    assert (snap.run, snap.world_size, snap.last_step) == ("r", 2, 2)
    assert (snap.last_status.value, snap.last_revision) == ("partial", 1)
    assert (snap.open_steps, snap.partial_steps, snap.missing_ranks) == (1, 2, 4)
    assert snap.values["a"] == 1.0 and snap.values["mean"] is None


def test_requests_timed_by_route_template_and_status(api: Api, app: Any) -> None:
    api.register(world_size=1)
    api.send([(0, 0, 0, {"a": 1.0})], [(0, 0, 1)])
    api.step(0)
    api.step(0)
    assert api.client.get("/v1/runs/r/steps/99").status_code == 404
    assert api.client.get("/no/such/path").status_code == 404
    api.send([(1, 0, 0, {"a": "not a number"})])

    def count(method: str, route: str, status: str) -> float:
        labels = {"method": method, "route": route, "status": status}
        return _sample(app, "steptally_http_request_duration_seconds_count", **labels)

    assert count("POST", "/v1/runs", "201") == 1
    assert count("POST", "/v1/runs/{run}/fragments", "200") == 1
    assert count("POST", "/v1/runs/{run}/fragments", "422") == 1
    assert count("GET", "/v1/runs/{run}/steps/{step}", "200") == 2
    assert count("GET", "/v1/runs/{run}/steps/{step}", "404") == 1
    assert count("GET", "unmatched", "404") == 1
    assert _sample(app, "steptally_requests_rejected_total", code="unknown_step") == 1
    assert _sample(app, "steptally_requests_rejected_total", code="invalid_payload") == 1
    text = api.client.get("/metrics").text
    assert "/v1/runs/r/" not in text  # a template, never a raw path
    assert "_created" not in text
    assert 'route="/v1/runs/{run}/steps/{step}",status="200"' in text


def test_a_request_that_raises_is_timed_as_500() -> None:
    telemetry = Telemetry(CollectorRegistry())
    app = FastAPI()
    app.add_middleware(RequestMetrics, telemetry=telemetry)

    @app.get("/boom/{n}")
    def boom(n: int) -> None:
        raise RuntimeError(f"boom {n}")

    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/boom/1").status_code == 500
        assert client.get("/boom/2").status_code == 500
    labels = {"method": "GET", "route": "/boom/{n}", "status": "500"}
    name = "steptally_http_request_duration_seconds_count"
    assert telemetry.registry.get_sample_value(name, labels) == 2


def test_fragments_left_out_of_a_partial_batch_are_counted_by_code(api: Api, app: Any) -> None:
    api.register(world_size=2)
    api.send([(0, 0, 0, {"a": 1.0})])
    body = {
        "fragments": [
            {"step": 0, "rank": 0, "seq": 0, "values": {"a": 2.0}},  # conflict
            {"step": 0, "rank": 5, "seq": 0, "values": {"a": 1.0}},  # no such rank
            {"step": 0, "rank": 9, "seq": 0, "values": {"a": 1.0}},  # no such rank
            {"step": 1, "rank": 0, "seq": 0, "values": {"a": 1.0}},  # stored
        ]
    }
    answer = api.client.post("/v1/runs/r/fragments?partial=true", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["accepted"] == 1
    rejected = "steptally_fragments_rejected_total"
    assert _sample(app, rejected, run="r", code="fragment_conflict") == 1
    assert _sample(app, rejected, run="r", code="rank_out_of_range") == 2
    assert _sample(app, "steptally_fragments_accepted_total", run="r") == 2
