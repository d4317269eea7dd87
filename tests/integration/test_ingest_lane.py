"""The ingest lane: the reporter's requests skip FastAPI's general path, and every
answer — 200 or error, status, code, message, headers — is the one the FastAPI route
gives the same request (docs/api-contract.md, Errors and Fragments and commits)."""

from __future__ import annotations

import gzip
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.routing import Match
from starlette.types import Receive, Scope, Send

from steptally.client.wire import Commit, FragmentBatch, encode_columnar
from steptally.service.api import fragments
from steptally.service.api.fragments import IngestLane
from steptally.service.api.front import App

JSON = {"content-type": "application/json"}
GZIP = {**JSON, "content-encoding": "gzip"}
SETTINGS = {"max_body_bytes": 4096, "body_wait_s": 0.05}


def _lane(app: FastAPI) -> IngestLane:
    assert isinstance(app, App)
    lane = app.lane
    assert isinstance(lane, IngestLane)
    return lane


def _scope(method: str, path: str, query: bytes = b"", **extra: Any) -> Scope:
    return {"type": "http", "method": method, "path": path, "query_string": query, **extra}


def test_the_lane_takes_the_reporters_requests_and_nothing_else(app: FastAPI) -> None:
    lane = _lane(app)
    documented = next(r for r in fragments.router.routes if getattr(r, "path", "") == lane.path)
    for query in (b"", b"partial=true", b"partial=false"):
        match, child = lane.matches(_scope("POST", "/v1/runs/grpo-8b.v2_x/fragments", query))
        assert match == Match.FULL
        assert child == {"path_params": {"run": "grpo-8b.v2_x"}, "route": documented}
    longest = "r" * 128
    assert lane.matches(_scope("POST", f"/v1/runs/{longest}/fragments"))[0] == Match.FULL
    others = [
        _scope("GET", "/v1/runs/r/fragments"),
        _scope("PUT", "/v1/runs/r/fragments"),
        _scope("POST", "/v1/runs/r/fragments/"),
        _scope("POST", "/v1/runs/r/steps"),
        _scope("POST", "/v1/runs/-r/fragments"),
        _scope("POST", "/v1/runs/r r/fragments"),
        _scope("POST", "/v1/runs/r\n/fragments"),
        _scope("POST", "/v1/runs/é/fragments"),
        _scope("POST", f"/v1/runs/{longest}r/fragments"),
        _scope("POST", "/v1/runs/r/fragments", b"partial=yes"),
        _scope("POST", "/v1/runs/r/fragments", b"partial=true&partial=false"),
        _scope("POST", "/v1/runs/r/fragments", b"other=1"),
        _scope("POST", "/v1/runs/r/fragments", root_path="/behind"),
        {**_scope("POST", "/v1/runs/r/fragments"), "type": "websocket"},
    ]
    for scope in others:
        assert lane.matches(scope) == (Match.NONE, {}), scope


def _compact() -> bytes:
    batch = FragmentBatch(metrics=["n", "a"], steps=[1, 1], ranks=[0, 1], seqs=[0, 0])
    batch.values.extend([3.0, 1e17, 1.0, -1e17])
    batch.commits = [Commit(1, 0, 1), Commit(1, 1, 1)]
    return orjson.dumps(encode_columnar(batch))


def _rows(*fragments: tuple[int, int, int, dict[str, Any]], commits: Any = ()) -> bytes:
    body = {
        "fragments": [{"step": s, "rank": r, "seq": q, "values": v} for s, r, q, v in fragments],
        "commits": [{"step": s, "rank": r, "fragments": n} for s, r, n in commits],
    }
    return orjson.dumps(body)


# (path and query, body, headers, whether the lane takes it: the limits' middleware answers
# a body too long by its Content-Length or not JSON first); the run "r" has world size 2
# and metrics a (sum) and n (count); each request sees what the ones before it stored
REQUESTS: list[tuple[str, bytes, dict[str, str], bool]] = [
    ("/v1/runs/r/fragments", _rows((0, 0, 0, {"a": 1.5, "n": 2})), JSON, True),
    ("/v1/runs/r/fragments", _rows((0, 0, 0, {"a": 1.5, "n": 2})), JSON, True),  # duplicate
    ("/v1/runs/r/fragments", _rows((0, 0, 0, {"a": 2.5, "n": 2})), JSON, True),  # conflict
    ("/v1/runs/r/fragments?partial=true", _rows((0, 0, 0, {"a": 2.5, "n": 2})), JSON, True),
    ("/v1/runs/r/fragments?partial=false", _rows((0, 1, 0, {"a": 1.0})), JSON, True),
    ("/v1/runs/r/fragments", _rows(commits=[(0, 0, 1), (0, 1, 1)]), JSON, True),  # complete
    ("/v1/runs/r/fragments", _rows((0, 0, 1, {"a": 1.0})), JSON, True),  # step_complete
    ("/v1/runs/r/fragments", _rows((2, 5, 0, {"a": 1.0})), JSON, True),  # rank_out_of_range
    ("/v1/runs/r/fragments", gzip.compress(_compact()), GZIP, True),
    ("/v1/runs/r/fragments", b"{", JSON, True),  # bad_json
    ("/v1/runs/r/fragments", b"\xff\xfe", JSON, True),  # not UTF-8
    ("/v1/runs/r/fragments", b'{"fragments": [{"step": 0}]}', JSON, True),  # invalid_payload
    ("/v1/runs/r/fragments", _rows((3, 0, 0, {"zz": 1.0})), JSON, True),  # unknown_metric
    ("/v1/runs/r/fragments", _rows((3, 0, 0, {"a": "1.0"})), JSON, True),  # invalid_value
    ("/v1/runs/nope/fragments", _rows((0, 0, 0, {"a": 1.0})), JSON, True),  # unknown_run
    ("/v1/runs/r/fragments", b"{}" + b" " * 5000, JSON, False),  # too_large, by its length
    ("/v1/runs/r/fragments", gzip.compress(b"{}" + b" " * 50_000), GZIP, True),  # inflated
    ("/v1/runs/r/fragments", b"\x1f\x8b not gzip at all, long enough", GZIP, True),
    ("/v1/runs/r/fragments", _rows(), {**JSON, "content-encoding": "br"}, True),
    ("/v1/runs/r/fragments", _rows(), {"content-type": "text/plain"}, False),  # 415
    ("/v1/runs/r/fragments?partial=yes", _rows((4, 0, 0, {"a": 1.0})), JSON, False),
    ("/v1/runs/r/fragments?partial=maybe", _rows((4, 0, 1, {"a": 1.0})), JSON, False),
    ("/v1/runs/-r/fragments", _rows((4, 0, 2, {"a": 1.0})), JSON, False),  # path.run
    ("/v1/runs/r/fragments/", _rows((4, 0, 2, {"a": 1.0})), JSON, False),  # not_found
]


def _answers(
    client: TestClient, extra: Callable[[TestClient], list[Any]]
) -> list[tuple[int, dict[str, str], bytes]]:
    spec = {"name": "r", "world_size": 2, "metrics": {"a": "sum", "n": "count"}}
    assert client.post("/v1/runs", json=spec).status_code == 201
    out = []
    for path, body, headers, _ in REQUESTS:
        response = client.post(path, content=body, headers=headers)
        out.append((response.status_code, dict(response.headers), response.content))
    for response in extra(client):
        out.append((response.status_code, dict(response.headers), response.content))
    return out


def _busy(app: FastAPI) -> Callable[[TestClient], list[Any]]:
    """Requests while the body budget is full (503 with Retry-After), and a GET (405)."""

    def requests(client: TestClient) -> list[Any]:
        budget = app.state.body_budget
        budget.held = budget.capacity
        try:
            busy = client.post("/v1/runs/r/fragments", content=_rows(), headers=JSON)
        finally:
            budget.held = 0
        return [busy, client.get("/v1/runs/r/fragments")]

    return requests


def test_the_lane_answers_every_request_as_the_fastapi_route_does(
    make_client: Any, db_url: str, empty_database: Callable[[str], None]
) -> None:
    app, client = make_client(**SETTINGS)
    lane = _lane(app)
    served: list[str] = []
    handle = lane.handle

    async def counted(scope: Scope, receive: Receive, send: Send) -> None:
        served.append(scope["path"])
        await handle(scope, receive, send)

    lane.handle = counted  # type: ignore[method-assign,assignment]
    through_lane = _answers(client, _busy(app))
    assert len(served) == sum(taken for *_, taken in REQUESTS) + 1  # and the busy one

    empty_database(db_url)
    general, general_client = make_client(**SETTINGS)
    assert isinstance(general, App)
    general.close_lane()
    through_route = _answers(general_client, _busy(general))
    assert len(through_lane) == len(through_route) == len(REQUESTS) + 2
    labels = [f"{i}: {path}" for i, (path, *_) in enumerate(REQUESTS)] + ["busy", "get"]
    for label, one, other in zip(labels, through_lane, through_route, strict=True):
        assert one == other, label
    statuses = [status for status, _, _ in through_lane]
    assert statuses == [
        200, 200, 409, 200, 200, 200, 409, 422, 200, 400, 400, 422, 422, 422, 404, 413,
        413, 400, 400, 415, 200, 422, 422, 404, 503, 405,
    ]  # fmt: skip
    busy = through_lane[-2]
    assert busy[1]["retry-after"] == "5"
    assert orjson.loads(busy[2])["error"]["code"] == "unavailable"
    assert orjson.loads(through_lane[3][2])["rejected"][0]["code"] == "fragment_conflict"
    assert orjson.loads(through_lane[5][2])["finalised"] == [
        {"step": 0, "status": "complete", "revision": 1}
    ]


@pytest.mark.parametrize("query", ["", "?partial=true"])
def test_the_lanes_answer_is_the_documented_json(api: Any, query: str) -> None:
    api.register()
    body = _rows((0, 0, 0, {"a": 1.0, "n": 1}))
    response = api.client.post(f"/v1/runs/r/fragments{query}", content=body, headers=JSON)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.headers["content-length"] == str(len(response.content))
    expected: dict[str, Any] = {"accepted": 1, "duplicates": 0, "commits": 0, "finalised": []}
    if query:
        expected["rejected"] = []
    assert response.json() == expected


def _requests_counted(client: httpx.Client, status: int) -> float:
    route = 'route="/v1/runs/{run}/fragments"'
    for line in client.get("/metrics").text.splitlines():
        name = "steptally_http_request_duration_seconds_count{"
        if line.startswith(name) and route in line and f'status="{status}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("lane_open", [True, False])
def test_an_unexpected_failure_in_the_lane_is_500_json_counted_and_raised(
    make_client: Any, monkeypatch: pytest.MonkeyPatch, lane_open: bool
) -> None:
    """Both doors alike: 500 ``internal`` JSON, counted as a 500 of the route by the
    request metrics, and the exception raised on for the server's log."""
    app, client = make_client()
    assert isinstance(app, App)
    if not lane_open:
        app.close_lane()
    spec = {"name": "r", "world_size": 2, "metrics": {"a": "sum", "n": "count"}}
    assert client.post("/v1/runs", json=spec).status_code == 201

    def fail(*_: Any, **__: Any) -> None:
        raise RuntimeError("boom " * 1000)

    monkeypatch.setattr(app.state.service.ingest, "prepare", fail)
    body = _rows((0, 0, 0, {"a": 1.0}))
    with pytest.raises(RuntimeError, match="boom"):
        client.post("/v1/runs/r/fragments", content=body, headers=JSON)
    with TestClient(app, raise_server_exceptions=False) as quiet:
        response = quiet.post("/v1/runs/r/fragments", content=body, headers=JSON)
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["code"] == "internal" and "boom" not in error["message"]
        assert _requests_counted(quiet, 500) == 2


def test_both_doors_draw_on_one_rate_limit(make_client: Any) -> None:
    """The lane's guard is built from the app's own list with the same limiter: a
    client's requests through either door come out of one bucket."""
    _, client = make_client(rate_limit_per_s=0.001, rate_limit_burst=4)
    spec = {"name": "r", "world_size": 2, "metrics": {"a": "sum", "n": "count"}}
    assert client.post("/v1/runs", json=spec).status_code == 201  # 1
    body = _rows((0, 0, 0, {"a": 1.0}))
    assert client.post("/v1/runs/r/fragments", content=body, headers=JSON).status_code == 200
    general = client.post("/v1/runs/r/fragments?partial=maybe", content=body, headers=JSON)
    assert general.status_code == 422  # 3: FastAPI's route refuses the query
    assert client.post("/v1/runs/r/fragments", content=body, headers=JSON).status_code == 200
    for path in ("/v1/runs/r/fragments", "/v1/runs/r/fragments?partial=maybe"):
        limited = client.post(path, content=body, headers=JSON)
        assert limited.status_code == 429, path
        assert limited.json()["error"]["code"] == "rate_limited"
