"""Alert rules over REST, on both databases: registered with the run (and refused with a
reason), checked as each step finalises, shown in the step, the series, the breaches
pages, the event stream, the read client and ``/metrics``."""

from __future__ import annotations

import re
import threading
from typing import Any

import httpx
import pytest

from steptally.client.read import Client
from steptally.service.api import schemas
from tests.support.served import ServedService

Api = Any  # the `api` fixture of conftest.py
RULES = [
    {"name": "mean_high", "metric": "mean", "above": 2.0},
    {"name": "mean_jump", "metric": "mean", "change_above": 1.0, "window": 2},
    {"name": "ranks", "missing_ranks_above": 0},
]
SPEC = {
    "world_size": 2,
    "metrics": {"a": "sum", "n": "count"},
    "derived": {"mean": "a / n"},
    "alerts": RULES,
}


def _register(client: Any, **extra: Any) -> Any:
    return client.post("/v1/runs", json={"name": "r", **SPEC, **extra})


def _step(api: Api, step: int, value: float, ranks: tuple[int, ...] = (0, 1)) -> None:
    sent = api.send(
        [(step, r, 0, {"a": value, "n": 1}) for r in ranks], [(step, r, 1) for r in ranks]
    )
    assert sent.status_code == 200, sent.text


def test_rules_are_registered_shown_and_extended(api: Api) -> None:
    created = _register(api.client)
    assert created.status_code == 201
    assert created.json()["alerts"] == [
        RULES[0],
        {**RULES[1], "window": 2},
        RULES[2],
    ]
    more = _register(api.client, alerts=[*RULES, {"name": "lo", "metric": "a", "below": 0}])
    assert more.status_code == 200
    assert [r["name"] for r in more.json()["alerts"]] == ["mean_high", "mean_jump", "ranks", "lo"]
    assert api.client.post("/v1/runs", json={"name": "r", **SPEC}).status_code == 200  # kept
    assert [r["name"] for r in api.client.get("/v1/runs/r").json()["alerts"]][-1] == "lo"


def test_a_changed_or_bad_rule_is_refused_and_changes_nothing(api: Api) -> None:
    _register(api.client)
    changed = _register(api.client, alerts=[{**RULES[0], "above": 3.0}])
    assert changed.status_code == 409
    assert changed.json()["error"]["code"] == "spec_conflict"
    assert "alert rule 'mean_high'" in changed.json()["error"]["message"]
    bad = _register(api.client, alerts=[{"name": "x", "metric": "nope", "above": 1}])
    assert bad.status_code == 422
    error = bad.json()["error"]
    assert (error["code"], error["where"]) == ("invalid_spec", "alerts")
    assert "'nope'" in error["message"] and "does not declare" in error["message"]
    shape = _register(api.client, alerts=[{"name": "x", "metric": "a", "above": 1, "y": 2}])
    assert shape.status_code == 422
    assert api.client.get("/v1/runs/r").json()["alerts"][0]["above"] == 2.0


def test_breaches_are_in_the_step_the_series_and_the_pages(api: Api, app: Any, clock: Any) -> None:
    _register(api.client, step_timeout_s=60)
    for step, value in enumerate([1.0, 1.5, 3.0, 1.0]):
        _step(api, step, value)
    _step(api, 4, 2.5, ranks=(0,))
    app.state.service.sweep(clock.now + 120)  # step 4: partial, rank 1 missing
    assert api.step(1)["breaches"] == []
    assert api.step(2)["breaches"] == [
        {
            "rule": "mean_high",
            "condition": "above",
            "metric": "mean",
            "value": 3.0,
            "threshold": 2.0,
        },
        {
            "rule": "mean_jump",
            "condition": "change_above",
            "metric": "mean",
            "value": 3.0,
            "threshold": 1.0,
            "mean": 1.25,
        },
    ]
    # step 3: 1.0 against the mean of 1.5 and 3 (2.25) is 1.25 off
    assert [b["rule"] for b in api.step(3)["breaches"]] == ["mean_jump"]
    assert [b["rule"] for b in api.step(4)["breaches"]] == ["mean_high", "ranks"]
    listed = api.client.get("/v1/runs/r/steps").json()["steps"]
    assert [len(s["breaches"]) for s in listed] == [0, 0, 2, 1, 2]

    series = api.client.get("/v1/runs/r/series/mean").json()
    assert series["breaches"] == [
        {"step": 2, "rule": "mean_high"},
        {"step": 2, "rule": "mean_jump"},
        {"step": 3, "rule": "mean_jump"},
        {"step": 4, "rule": "mean_high"},
    ]  # the rank rule is on no metric
    assert api.client.get("/v1/runs/r/series/a").json()["breaches"] == []

    first = api.client.get("/v1/runs/r/breaches", params={"limit": 2}).json()
    assert [(b["step"], b["rule"]) for b in first["breaches"]] == [
        (2, "mean_high"),
        (2, "mean_jump"),
    ]
    assert first["breaches"][0]["revision"] == 1 and first["breaches"][0]["finalised_at"]
    rest = api.client.get(
        "/v1/runs/r/breaches", params={"limit": 2, "cursor": first["next_cursor"]}
    ).json()
    assert [(b["step"], b["rule"]) for b in rest["breaches"]] == [
        (3, "mean_jump"),
        (4, "mean_high"),
    ]
    last = api.client.get("/v1/runs/r/breaches", params={"cursor": rest["next_cursor"]}).json()
    assert [(b["step"], b["rule"]) for b in last["breaches"]] == [(4, "ranks")]
    assert last["next_cursor"] is None
    only = api.client.get("/v1/runs/r/breaches", params={"rule": "ranks", "start": 4}).json()
    assert [(b["step"], b["value"]) for b in only["breaches"]] == [(4, 1.0)]
    unknown = api.client.get("/v1/runs/r/breaches", params={"rule": "nope"})
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "rule_not_found")
    bad = api.client.get("/v1/runs/r/breaches", params={"cursor": "x"})
    assert bad.status_code == 422

    # the answers are what /openapi.json documents
    schemas.RunAnswer.model_validate(api.client.get("/v1/runs/r").json())
    schemas.StepPage.model_validate(api.client.get("/v1/runs/r/steps").json())
    schemas.SeriesAnswer.model_validate(series)
    for page in (first, rest, last):
        schemas.BreachPage.model_validate(page)

    text = api.client.get("/metrics").text
    for rule, n in (("mean_high", 2), ("mean_jump", 2), ("ranks", 1)):
        assert f'steptally_alert_breaches_total{{rule="{rule}",run="r"}} {n}.0' in text


def test_the_stream_and_the_read_client_carry_breaches(served: ServedService) -> None:
    url = served.url
    assert httpx.post(f"{url}/v1/runs", json={"name": "r", **SPEC}).status_code == 201
    with Client(url) as client:
        run = client.run("r")
        follower = run.follow()
        got: list[dict[str, Any]] = []
        done = threading.Event()

        def read() -> None:
            for step in follower:
                got.append(step)
                if len(got) == 3:
                    done.set()
                    return

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        for step, value in enumerate([1.0, 1.0, 5.0]):
            body = {
                "fragments": [
                    {"step": step, "rank": r, "seq": 0, "values": {"a": value, "n": 1}}
                    for r in (0, 1)
                ],
                "commits": [{"step": step, "rank": r, "fragments": 1} for r in (0, 1)],
            }
            assert httpx.post(f"{url}/v1/runs/r/fragments", json=body).status_code == 200
        assert done.wait(20), f"the stream gave {len(got)} steps"
        follower.close()
        assert [[b["rule"] for b in s["breaches"]] for s in got] == [
            [],
            [],
            ["mean_high", "mean_jump"],
        ]
        frame = run.breaches()
        assert frame["rule"].tolist() == ["mean_high", "mean_jump"]
        assert frame["value"].tolist() == [5.0, 5.0]
        assert frame["mean"].isna().tolist() == [True, False]
        assert frame["mean"].iloc[1] == 1.0
        assert run.breaches(rules=["mean_jump"], format="records")[0]["threshold"] == 1.0
    metrics = httpx.get(f"{url}/metrics").text
    assert re.search(r'steptally_alert_breaches_total\{rule="ranks",run="r"\} 0\.0', metrics)


@pytest.mark.parametrize("metric", ["a", "mean"])
def test_an_open_step_shows_no_breaches(api: Api, metric: str) -> None:
    _register(api.client)
    api.send([(0, 0, 0, {"a": 9.0, "n": 1})], [(0, 0, 1)])
    shown = api.step(0)
    assert (shown["status"], shown["breaches"]) == ("open", [])
    assert api.client.get(f"/v1/runs/r/series/{metric}").json()["breaches"] == []
