"""Every limit holds before the work it bounds, on SQLite and PostgreSQL: each hostile
input is a short 4xx JSON error from the contract and changes nothing."""

from __future__ import annotations

import gzip
import time
from fractions import Fraction
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from .conftest import Api, AppFactory, Clock

BIG = 2**63
SPEC = {"name": "r", "world_size": 2, "metrics": {"a": "sum", "n": "count"}, "step_timeout_s": 60}


def _error(response: Any, status: int, code: str, where: str | None = ...) -> dict[str, Any]:  # type: ignore[assignment]
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == code
    if where is not ...:
        assert error["where"] == where
    assert len(error["message"]) <= 400
    return error


def _no_runs(api: Api) -> None:
    assert api.client.get("/v1/runs").json() == {"runs": [], "next_cursor": None}


@pytest.mark.parametrize("world_size", [0, 1_048_577, 2**31 - 1, 2**62, 10**20])
def test_world_size_out_of_range_is_422(api: Api, world_size: int) -> None:
    error = _error(
        api.client.post("/v1/runs", json={**SPEC, "world_size": world_size}),
        422,
        "invalid_spec",
        "world_size",
    )
    assert error["message"] == ("world_size must be from 1 to 1048576 (STEPTALLY_MAX_WORLD_SIZE)")
    _no_runs(api)


def test_world_size_limit_is_a_setting(make_client: AppFactory) -> None:
    _, client = make_client(max_world_size=4)
    assert client.post("/v1/runs", json={**SPEC, "world_size": 4}).status_code == 201
    _error(
        client.post("/v1/runs", json={**SPEC, "name": "s", "world_size": 5}),
        422,
        "invalid_spec",
        "world_size",
    )


def test_a_100000_rank_run_where_one_rank_reports_reads_in_under_a_second(
    make_client: AppFactory, clock: Clock
) -> None:
    app, client = make_client()
    api = Api(client)
    assert api.register(world_size=100_000).status_code == 201
    assert api.send([(0, 7, 0, {"a": 1.5, "n": 3})], [(0, 7, 1)]).status_code == 200

    def timed(call: Any) -> Any:
        started = time.perf_counter()
        out = call()
        assert time.perf_counter() - started < 1.0
        return out

    step = timed(lambda: api.step(0))
    assert (step["status"], step["ranks_committed"]) == ("open", [7])
    assert step["ranks_missing"] == [*range(7), *range(8, 1001)]
    assert step["ranks_missing_count"] == 99_999
    assert timed(lambda: client.get("/v1/runs/r")).json()["steps"]["open"] == 1
    clock.now += 61
    swept = timed(lambda: app.state.service.sweep())
    assert [(f.step, f.status.value) for f in swept] == [(0, "partial")]
    step = timed(lambda: api.step(0))
    assert (step["status"], len(step["ranks_missing"]), step["ranks_missing_count"]) == (
        "partial",
        1000,
        99_999,
    )
    series = timed(lambda: client.get("/v1/runs/r/series/a")).json()
    assert (series["steps"], series["values"]) == ([0], [1.5])
    metrics = timed(lambda: client.get("/metrics")).text
    assert 'steptally_missing_ranks{run="r"} 99999.0' in metrics


def test_a_chain_of_derived_expressions_is_refused_at_registration(api: Api) -> None:
    derived = {f"d{i + 1}": f"d{i} * d{i}" for i in range(40)}
    body = {**SPEC, "metrics": {"d0": "sum"}, "derived": derived}
    started = time.perf_counter()
    error = _error(api.client.post("/v1/runs", json=body), 422, "invalid_spec", "metrics")
    assert time.perf_counter() - started < 1.0
    assert error["message"] == (
        "the derived expressions have more than 10000 operands (derived names expanded); use fewer"
    )
    chain = {f"d{i + 1}": f"d{i} + 1" for i in range(17)}
    error = _error(
        api.client.post("/v1/runs", json={**body, "derived": chain}), 422, "invalid_spec"
    )
    assert error["message"] == (
        "the derived expressions have more than 16 derived values in one chain; use a shorter chain"
    )
    _no_runs(api)


def test_a_costly_spec_already_stored_cannot_freeze_the_sweeper(
    make_client: AppFactory, clock: Clock
) -> None:
    """Registered under looser limits, then served with the defaults: evaluation is bounded."""
    _, loose = make_client(max_derived_size=2**50, max_derived_chain=100)
    derived = {f"d{i + 1}": f"d{i} * d{i}" for i in range(40)}
    body = {**SPEC, "metrics": {"d0": "sum"}, "derived": derived}
    assert loose.post("/v1/runs", json=body).status_code == 201
    assert Api(loose).send([(0, 0, 0, {"d0": 1.1})], [(0, 0, 1)]).status_code == 200
    app, client = make_client()  # a restart with the default limits
    clock.now += 61
    started = time.perf_counter()
    swept = app.state.service.sweep()
    assert time.perf_counter() - started < 1.0
    assert [(f.step, f.status.value) for f in swept] == [(0, "partial")]
    started = time.perf_counter()
    metrics = Api(client).step(0)["metrics"]
    assert time.perf_counter() - started < 1.0
    assert metrics["d1"]["value"] == float(Fraction(1.1) ** 2)  # rounded once
    assert metrics["d10"]["value"] == float(Fraction(1.1) ** 1024)
    assert metrics["d40"]["value"] is None
    assert metrics["d40"]["reason"] == (
        "`d39` is undefined: an exact intermediate value has more than 65536 bits; "
        "simplify the expression"
    )
    assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize(
    ("name", "where"),
    [("nl\n", "name"), ("a\x00b", "name"), (" a", "name"), ("é", "name"), ("a" * 129, "name")],
)
def test_run_names_are_matched_in_full(api: Api, name: str, where: str) -> None:
    error = _error(
        api.client.post("/v1/runs", json={**SPEC, "name": name}), 422, "invalid_spec", where
    )
    assert name not in error["message"] or len(name) < 40
    _no_runs(api)


@pytest.mark.parametrize("metric", ["a\n", "a\x00", " a", "é", "a" * 129])
def test_metric_names_are_matched_in_full(api: Api, metric: str) -> None:
    error = _error(
        api.client.post("/v1/runs", json={**SPEC, "metrics": {metric: "sum"}}),
        422,
        "invalid_spec",
        "metrics",
    )
    assert len(error["message"]) < 200
    _no_runs(api)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/runs/a%00b",
        "/v1/runs/a%00b/steps/0",
        "/v1/runs/a%0A/steps",
        "/v1/runs/%20a/series/a",
        "/v1/runs/" + "a" * 300,
        "/v1/runs/%C3%A9/events",
    ],
)
def test_a_run_name_in_a_path_is_checked_before_any_lookup(api: Api, path: str) -> None:
    _error(api.client.get(path), 422, "invalid_payload", "path.run")
    _error(
        api.client.post("/v1/runs/a%00b/fragments", json={"fragments": []}),
        422,
        "invalid_payload",
        "path.run",
    )


@pytest.mark.parametrize(
    ("path", "where"),
    [
        (f"/v1/runs/r/steps/{BIG}", "path.step"),
        ("/v1/runs/r/steps/99999999999999999999999", "path.step"),
        (f"/v1/runs/r/steps?start={BIG}", "query.start"),
        (f"/v1/runs/r/steps?end={BIG}", "query.end"),
        ("/v1/runs/r/steps?start=-1", "query.start"),
        (f"/v1/runs/r/series/a?start={BIG}", "query.start"),
        ("/v1/runs/r/series/a?points=abc", "query.points"),
        ("/v1/runs/r/series/a?points=1", "query.points"),
        ("/v1/runs/r/steps?cursor=%C2%B2", "query.cursor"),
        (f"/v1/runs/r/steps?cursor={BIG * 10}", "query.cursor"),
        ("/v1/runs/r/steps?cursor=-1", "query.cursor"),
        ("/v1/runs/r/steps?limit=0", "query.limit"),
        ("/v1/runs?cursor=%C2%B2", "query.cursor"),
        ("/v1/runs?limit=99999999999999999999999", "query.limit"),
    ],
)
def test_query_and_path_parameters_are_validated(api: Api, path: str, where: str) -> None:
    assert api.register().status_code == 201
    _error(api.client.get(path), 422, "invalid_payload", where)


def test_a_cursor_past_the_last_possible_step_is_an_empty_last_page(api: Api) -> None:
    assert api.register().status_code == 201
    page = api.client.get("/v1/runs/r/steps", params={"cursor": str(BIG - 1)})
    assert (page.status_code, page.json()) == (200, {"steps": [], "next_cursor": None})


def _fragment(**changes: Any) -> dict[str, Any]:
    return {"fragments": [{"step": 0, "rank": 0, "seq": 0, "values": {"a": 1.0}, **changes}]}


@pytest.mark.parametrize(
    ("body", "code", "where"),
    [
        (_fragment(step=BIG), "invalid_payload", "fragments[0].step"),
        (_fragment(step=2**64), "invalid_payload", "fragments[0].step"),
        (_fragment(seq=BIG), "invalid_payload", "fragments[0].seq"),
        (_fragment(rank=BIG), "invalid_payload", "fragments[0].rank"),
        (
            {"commits": [{"step": 0, "rank": 0, "fragments": BIG}]},
            "invalid_payload",
            "commits[0].fragments",
        ),
        (
            {"commits": [{"step": BIG, "rank": 0, "fragments": 1}]},
            "invalid_payload",
            "commits[0].step",
        ),
        (_fragment(values={"n": float(BIG)}), "invalid_value", "fragments[0].values.n"),
    ],
)
def test_integers_at_or_past_2_63_are_422(
    api: Api, body: dict[str, Any], code: str, where: str
) -> None:
    assert api.register().status_code == 201
    _error(api.client.post("/v1/runs/r/fragments", json=body), 422, code, where)
    _error(api.client.get("/v1/runs/r/steps/0"), 404, "unknown_step")


@pytest.mark.parametrize("timeout", ["Infinity", "-Infinity", "NaN", "1e308", "0", "-1"])
def test_step_timeout_is_finite_and_bounded(api: Api, timeout: str) -> None:
    raw = '{"name": "t", "world_size": 1, "metrics": {}, "step_timeout_s": ' + timeout + "}"
    response = api.client.post(
        "/v1/runs", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 422, response.text
    assert response.json()["error"]["where"] == "step_timeout_s"
    _no_runs(api)


def test_a_spec_of_8_mb_is_413_and_other_routes_have_their_limits(api: Api) -> None:
    spec = {**SPEC, "derived": {f"x{i}": "a" for i in range(400_000)}}
    error = _error(api.client.post("/v1/runs", json=spec), 413, "too_large")
    assert error["message"] == (
        "the body is larger than the limit of 1048576 bytes for this route "
        "(STEPTALLY_MAX_SPEC_BODY_BYTES)"
    )
    _no_runs(api)
    chunks = (b"x" * 65536 for _ in range(20))  # no Content-Length: cut off while streaming
    streamed = api.client.post(
        "/v1/runs", content=chunks, headers={"content-type": "application/json"}
    )
    _error(streamed, 413, "too_large")
    _error(api.client.request("GET", "/v1/runs", content=b"x" * 70_000), 413, "too_large")
    _no_runs(api)


def test_fragment_bodies_and_gzip_bombs_are_bounded(make_client: AppFactory) -> None:
    _, client = make_client(max_body_bytes=100_000)
    api = Api(client)
    assert api.register().status_code == 201
    frags = [{"step": 0, "rank": 0, "seq": i, "values": {"a": 1.0}} for i in range(5000)]
    big = _error(client.post("/v1/runs/r/fragments", json={"fragments": frags}), 413, "too_large")
    assert "STEPTALLY_MAX_BODY_BYTES" in big["message"]
    bomb = gzip.compress(b'{"fragments": [' + b" " * 50_000_000 + b"]}")
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    _error(client.post("/v1/runs/r/fragments", content=bomb, headers=headers), 413, "too_large")
    liar = bytearray(gzip.compress(b'{"fragments": [' + b" " * 50_000 + b"]}"))
    liar[-4:] = (10).to_bytes(4, "little")  # a trailer that claims 10 bytes
    _error(
        client.post("/v1/runs/r/fragments", content=bytes(liar), headers=headers), 400, "bad_json"
    )
    _error(client.get("/v1/runs/r/steps/0"), 404, "unknown_step")


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/xml",
    ],
)
def test_a_non_json_body_is_415(api: Api, content_type: str) -> None:
    headers = {"content-type": content_type}
    spec = '{"name": "r", "world_size": 1, "metrics": {"a": "sum"}}'
    error = _error(
        api.client.post("/v1/runs", content=spec, headers=headers), 415, "unsupported_media_type"
    )
    assert error["message"] == "this route takes JSON: send Content-Type: application/json"
    _no_runs(api)
    assert api.register().status_code == 201
    body = '{"fragments": [{"step": 0, "rank": 0, "seq": 0, "values": {"a": 1}}]}'
    _error(
        api.client.post("/v1/runs/r/fragments", content=body, headers=headers),
        415,
        "unsupported_media_type",
    )
    _error(api.client.get("/v1/runs/r/steps/0"), 404, "unknown_step")


def test_framework_errors_have_contract_codes_and_no_redirect_names_the_host(api: Api) -> None:
    _error(api.client.delete("/v1/runs"), 405, "method_not_allowed")
    _error(api.client.get("/v1/nothing"), 404, "not_found")
    slash = api.client.get("/v1/runs/", headers={"host": "evil.example"}, follow_redirects=False)
    _error(slash, 404, "not_found")
    assert "location" not in slash.headers
    latin = api.client.post(
        "/v1/runs", content=b'{"name": "\xff"}', headers={"content-type": "application/json"}
    )
    _error(latin, 400, "bad_json")
    _no_runs(api)


def test_error_messages_never_echo_the_whole_input(api: Api) -> None:
    long = "x" * 5000
    for response in (
        api.client.post("/v1/runs", json={**SPEC, "metrics": {long: "sum"}}),
        api.client.post("/v1/runs", json={**SPEC, "name": long}),
        api.client.post("/v1/runs", json={**SPEC, "derived": {"d": long + " +"}}),
    ):
        assert response.status_code == 422
        assert long[:100] not in response.text
        assert len(response.content) < 600
    assert api.register().status_code == 201
    unknown = api.client.get(f"/v1/runs/r/series/{long}")
    _error(unknown, 404, "metric_not_found")
    assert long[:100] not in unknown.text


def test_an_unexpected_failure_is_500_json(
    app_and_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    app, _ = app_and_client

    def fail(*_: Any) -> None:
        raise RuntimeError("boom " * 1000)

    monkeypatch.setattr(app.state.service, "list_runs", fail)
    with TestClient(app, raise_server_exceptions=False) as client:
        error = _error(client.get("/v1/runs"), 500, "internal", None)
    assert "boom" not in error["message"]


def test_metrics_shows_the_runs_active_within_the_window(
    make_client: AppFactory, clock: Clock
) -> None:
    _, client = make_client(metrics_window_s=3600)
    api = Api(client)
    assert api.register(name="old", world_size=1).status_code == 201
    assert api.send([(0, 0, 0, {"a": 1.0})], [(0, 0, 1)], run="old").status_code == 200
    assert api.register(name="stuck", world_size=2).status_code == 201
    assert api.send([(0, 0, 0, {"a": 1.0})], [(0, 0, 1)], run="stuck").status_code == 200
    before = client.get("/metrics").text
    assert 'steptally_world_size{run="old"} 1.0' in before
    assert 'steptally_metric_value{metric="a",run="old"} 1.0' in before
    clock.now += 3601
    assert api.register(name="new", world_size=3).status_code == 201
    text = client.get("/metrics").text
    assert 'steptally_world_size{run="old"}' not in text
    assert 'steptally_metric_value{metric="a",run="old"}' not in text
    assert 'steptally_world_size{run="new"} 3.0' in text
    assert 'steptally_open_steps{run="stuck"} 1.0' in text  # open steps keep a run shown


def test_a_50_mb_batch_is_refused_before_it_is_read(api: Api) -> None:
    assert api.register().status_code == 201
    body = b'{"fragments": [' + b" " * 50_000_000 + b"]}"
    started = time.perf_counter()
    error = _error(
        api.client.post(
            "/v1/runs/r/fragments", content=body, headers={"content-type": "application/json"}
        ),
        413,
        "too_large",
    )
    assert time.perf_counter() - started < 2.0
    assert error["message"] == (
        "the body is larger than the limit of 8388608 bytes for this route "
        "(STEPTALLY_MAX_BODY_BYTES)"
    )


def test_a_value_the_database_refuses_is_422_and_a_database_away_503(
    app_and_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    app, client = app_and_client

    def refuse(*_: Any) -> None:
        raise sa.exc.DataError("SELECT", {}, Exception("value out of range"))

    def away(*_: Any) -> None:
        raise sa.exc.OperationalError("SELECT", {}, Exception("server closed the connection"))

    monkeypatch.setattr(app.state.service, "list_runs", refuse)
    _error(client.get("/v1/runs"), 422, "invalid_payload", None)
    monkeypatch.setattr(app.state.service, "list_runs", away)
    answer = client.get("/v1/runs")
    _error(answer, 503, "unavailable", None)
    assert answer.headers["retry-after"] == "5"
