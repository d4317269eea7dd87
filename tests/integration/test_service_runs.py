"""Registering runs: 201 new, 200 same or superset, 409 conflicts, 422 invalid, 404 unknown."""

from __future__ import annotations

from typing import Any

Api = Any  # the `api` fixture of conftest.py


def test_new_run_is_201_and_same_spec_is_200(api: Api) -> None:
    first = api.register(derived={"mean": "a / n"})
    assert first.status_code == 201
    again = api.register(derived={"mean": "a/n"})  # same meaning, other spelling
    assert again.status_code == 200
    assert again.json()["metrics"] == {"a": "sum", "n": "count"}
    assert again.json()["derived"] == {"mean": "a / n"}


def test_superset_adds_metrics_and_keeps_the_rest(api: Api) -> None:
    api.register()
    bigger = api.register(metrics={"a": "sum", "m": "max"}, derived={"x": "a * 2"})
    assert bigger.status_code == 200
    assert bigger.json()["metrics"] == {"a": "sum", "n": "count", "m": "max"}
    assert bigger.json()["derived"] == {"x": "a * 2"}


def test_changed_kind_is_spec_conflict_naming_it(api: Api) -> None:
    api.register()
    response = api.register(metrics={"a": "max", "n": "count"})
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "spec_conflict"
    assert "'a'" in error["message"] and "sum" in error["message"]
    assert api.client.get("/v1/runs/r").json()["metrics"]["a"] == "sum"


def test_changed_derived_meaning_and_world_size_conflict(api: Api) -> None:
    api.register(derived={"mean": "a / n"})
    derived = api.register(derived={"mean": "n / a"})
    assert derived.status_code == 409
    assert "mean" in derived.json()["error"]["message"]
    world = api.register(world_size=4, derived={"mean": "a / n"})
    assert world.status_code == 409
    assert "world size" in world.json()["error"]["message"]


def test_invalid_specs_are_422(api: Api) -> None:
    bad_kind = api.register(metrics={"a": "average"})
    assert bad_kind.status_code == 422
    assert bad_kind.json()["error"]["code"] == "invalid_spec"
    bad_expr = api.register(derived={"x": "a / zzz"})
    assert bad_expr.json()["error"]["code"] == "invalid_spec"
    bad_name = api.register(name="-nope")
    assert bad_name.json()["error"]["code"] == "invalid_spec"
    missing = api.client.post("/v1/runs", json={"name": "r"})
    assert missing.status_code == 422
    assert missing.json()["error"]["code"] == "invalid_payload"


def test_malformed_json_is_bad_json(api: Api) -> None:
    response = api.client.post(
        "/v1/runs", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "bad_json"


def test_list_and_get_runs(api: Api) -> None:
    api.register(name="b")
    api.register(name="a", world_size=1)
    api.send([(0, 0, 0, {"a": 1.0, "n": 1})], [(0, 0, 1)], run="a")
    runs = api.client.get("/v1/runs").json()["runs"]
    assert [r["name"] for r in runs] == ["a", "b"]
    a = api.client.get("/v1/runs/a").json()
    assert a["last_finalised_step"] == 0
    assert a["steps"] == {"open": 0, "complete": 1, "partial": 0}
    assert a["step_timeout_s"] == 60.0
    assert a["created_at"].endswith("+00:00")
    assert a["last_finalised_at"] == "1970-01-12T13:46:40+00:00"  # the test clock's now
    assert api.client.get("/v1/runs/b").json()["last_finalised_at"] is None


def test_runs_come_in_pages_by_name(api: Api) -> None:
    names = ["m", "b", "z.9", "a-1", "q", "A"]
    for name in names:
        api.register(name=name)
    seen, cursor, pages = [], None, 0
    while True:
        params: dict[str, Any] = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        page = api.client.get("/v1/runs", params=params).json()
        seen += [r["name"] for r in page["runs"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert (seen, pages) == (sorted(names), 3)
    whole = api.client.get("/v1/runs").json()
    assert ([r["name"] for r in whole["runs"]], whole["next_cursor"]) == (sorted(names), None)
    last = api.client.get("/v1/runs", params={"limit": 5}).json()
    assert last["next_cursor"] == sorted(names)[4]
    for params, where in (
        ({"limit": 0}, "query.limit"),
        ({"limit": 1001}, "query.limit"),
        ({"cursor": "/"}, "query.cursor"),
    ):
        bad = api.client.get("/v1/runs", params=params)
        assert bad.status_code == 422
        assert (bad.json()["error"]["code"], bad.json()["error"]["where"]) == (
            "invalid_payload",
            where,
        )


def test_unknown_run_is_404_everywhere(api: Api) -> None:
    for path in ("/v1/runs/zz", "/v1/runs/zz/steps/0", "/v1/runs/zz/steps", "/v1/runs/zz/series/a"):
        response = api.client.get(path)
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == "unknown_run"
    posted = api.send([(0, 0, 0, {"a": 1.0})], run="zz")
    assert posted.status_code == 404
    assert posted.json()["error"] == {
        "code": "unknown_run",
        "message": posted.json()["error"]["message"],
        "where": None,
    }
