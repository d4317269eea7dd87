"""The typed API: /openapi.json documents every JSON route and its errors, real answers
match the documented models, and /docs is Swagger UI served from the package alone."""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel

from steptally.service.api import docs, events, fragments, health, runs, schemas, steps

Api = Any  # the `api` fixture of conftest.py

STREAMS = {"/v1/runs/{run}/events"}
ERRORS = {
    ("POST", "/v1/runs"): {"400", "409", "422"},
    ("POST", "/v1/runs/{run}/fragments"): {"400", "404", "409", "413", "422"},
    ("GET", "/v1/runs/{run}"): {"404", "422"},
    ("GET", "/v1/runs"): {"422"},
    ("GET", "/v1/runs/{run}/steps"): {"404", "422"},
    ("GET", "/readyz"): {"503"},
    ("GET", "/v1/runs/{run}/steps/{step}"): {"404", "422"},
    ("GET", "/v1/runs/{run}/series/{metric}"): {"404", "422"},
    ("GET", "/v1/runs/{run}/breaches"): {"404", "422"},
    ("GET", "/v1/runs/{run}/events"): {"404", "422"},
}


def _json_routes() -> list[tuple[str, str]]:
    """(method, path) of every route of the API's routers that the schema shows."""
    out = []
    for module in (runs, fragments, steps, events, health, docs):
        for route in module.router.routes:
            if isinstance(route, APIRoute) and route.include_in_schema:
                out += [(m, route.path) for m in sorted(route.methods)]
    return out


def _ref(content: dict[str, Any]) -> str:
    schema = content["application/json"]["schema"]
    return str(schema.get("$ref", ""))


def test_openapi_documents_every_route_and_its_errors(api: Api) -> None:
    spec = api.client.get("/openapi.json").json()
    routes = _json_routes()
    assert ("GET", "/v1/runs/{run}/series/{metric}") in routes
    assert len(routes) >= 10
    for method, path in routes:
        responses = spec["paths"][path][method.lower()]["responses"]
        ok = [s for s in responses if s.startswith("2")]
        assert ok, (method, path)
        for status in ok:
            content = responses[status]["content"]
            if path in STREAMS:
                assert "text/event-stream" in content
            else:
                assert _ref(content).startswith("#/components/schemas/"), (method, path, status)
        for status in ERRORS.get((method, path), set()):
            assert _ref(responses[status]["content"]) == "#/components/schemas/ErrorAnswer"
        assert "HTTPValidationError" not in str(responses), (method, path)
    series = spec["components"]["schemas"]["SeriesAnswer"]["properties"]
    assert set(series) == {
        "metric", "kind", "total", "downsampled", "steps", "values", "status", "revision",
        "breaches",
    }  # fmt: skip


def _check(model: type[BaseModel], body: Any) -> None:
    model.model_validate(body, strict=False)


def test_real_answers_match_the_documented_models(app: FastAPI, api: Api, clock: Any) -> None:
    _check(schemas.RunAnswer, api.register(world_size=2, derived={"mean": "a / n"}).json())
    sent = api.send([(0, 0, 0, {"a": "NaN", "n": 1}), (0, 1, 0, {"a": 1.0, "n": 1})])
    _check(schemas.IngestAnswer, sent.json())
    done = api.send([(1, 0, 0, {"a": "Infinity", "n": 0})], [(0, 0, 1), (0, 1, 1), (1, 0, 1)])
    assert done.json()["finalised"] == [{"step": 0, "status": "complete", "revision": 1}]
    _check(schemas.IngestAnswer, done.json())
    app.state.service.sweep(clock.now + 120)  # step 1 partial
    get = api.client.get
    _check(schemas.RunPage, get("/v1/runs").json())
    _check(schemas.RunAnswer, get("/v1/runs/r").json())
    for step in (0, 1):
        _check(schemas.StepAnswer, get(f"/v1/runs/r/steps/{step}").json())
    _check(schemas.StepPage, get("/v1/runs/r/steps").json())
    for metric in ("a", "n", "mean"):
        series = get(f"/v1/runs/r/series/{metric}").json()
        _check(schemas.SeriesAnswer, series)
    assert get("/v1/runs/r/series/mean").json()["values"] == ["NaN", None]
    _check(schemas.HealthAnswer, get("/healthz").json())
    _check(schemas.HealthAnswer, get("/readyz").json())
    for path in ("/v1/runs/zz", "/v1/runs/r/series/a?points=1"):
        _check(schemas.ErrorAnswer, get(path).json())


def test_docs_is_swagger_ui_from_local_assets(api: Api) -> None:
    page = api.client.get("/docs")
    assert page.status_code == 200
    html = page.text
    links = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", html)
    assert sorted(links) == [
        "/docs/assets/favicon-32x32.png",
        "/docs/assets/swagger-ui-bundle.js",
        "/docs/assets/swagger-ui.css",
    ]
    assert "'/openapi.json'" in html or '"/openapi.json"' in html
    assert "http://" not in html and "https://" not in html
    for link, kind in zip(sorted(links), ("image/png", "text/javascript", "text/css"), strict=True):
        asset = api.client.get(link)
        assert asset.status_code == 200
        assert asset.headers["content-type"].startswith(kind)
        assert asset.headers["cache-control"] == "public, max-age=86400"
        assert len(asset.content) > 500
    assert "SwaggerUIBundle" in api.client.get("/docs/assets/swagger-ui-bundle.js").text
    missing = api.client.get("/docs/assets/../../settings.py")
    assert missing.status_code == 404
    assert api.client.get("/docs/assets/index.html").json()["error"]["code"] == "not_found"
    assert api.client.get("/redoc").status_code == 404
