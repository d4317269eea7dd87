"""``/docs``: Swagger UI served from the package, so it works without the internet.

The Swagger UI files (``swagger-ui-dist``, Apache-2.0, its LICENSE and NOTICE beside
them in ``swagger/``) are vendored unchanged; ``/docs`` is FastAPI's own Swagger
page pointed at them, and ``/docs/assets/{name}`` serves them with a long cache
lifetime (a new version of the files comes with a new release of the service).

With auth on, :func:`declare_bearer` makes the OpenAPI description declare the bearer
token, so ``/docs`` has an "Authorize" button and its "Try it out" requests carry the
token.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from starlette.responses import HTMLResponse, Response

from steptally.service.errors import NotFound

router = APIRouter(include_in_schema=False)

ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon-32x32.png": "image/png",
}
CACHE = "public, max-age=86400"
BEARER = {
    "type": "http",
    "scheme": "bearer",
    "description": "a token from `steptally token create` (docs/security.md)",
}
_FOLDER = files("steptally.service.api") / "swagger"


@router.get("/docs")
def swagger_ui(request: Request) -> HTMLResponse:
    app = request.app
    return get_swagger_ui_html(
        openapi_url=app.openapi_url,
        title=f"{app.title} — API",
        swagger_js_url="/docs/assets/swagger-ui-bundle.js",
        swagger_css_url="/docs/assets/swagger-ui.css",
        swagger_favicon_url="/docs/assets/favicon-32x32.png",
    )


@router.get("/docs/assets/{name}")
def swagger_asset(name: str) -> Response:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise NotFound(f"/docs has no asset {name!r}")
    body = (_FOLDER / name).read_bytes()
    return Response(body, media_type=media_type, headers={"Cache-Control": CACHE})


# the body of POST /v1/runs/{run}/fragments, read by the ingest route itself (its two
# forms and every check: docs/api-contract.md, Fragments and commits)
FRAGMENTS_BODY = {
    "required": True,
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "description": "fragments and commits, in the row form (`fragments`, "
                "`commits`) or the compact form (`columnar`); docs/api-contract.md",
                "properties": {  # null: the same as left out
                    "fragments": {"type": ["array", "null"], "items": {"type": "object"}},
                    "commits": {"type": ["array", "null"], "items": {"type": "object"}},
                    "columnar": {"type": ["object", "null"]},
                },
                "not": {"required": ["fragments", "columnar"]},  # one form or the other
            }
        }
    },
}


def describe_limits(app: FastAPI, max_world_size: int, max_step_timeout_s: float) -> None:
    """Write into ``/openapi.json`` what the routes read themselves: the fragments
    body, and the bounds of a run's spec that this service's settings set."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            body = schema["components"]["schemas"]["RunBody"]["properties"]
            body["world_size"]["maximum"] = max_world_size
            body["step_timeout_s"]["maximum"] = max_step_timeout_s
            post = schema["paths"]["/v1/runs/{run}/fragments"]["post"]
            post["requestBody"] = FRAGMENTS_BODY
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def declare_bearer(app: FastAPI) -> None:
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {}).setdefault("securitySchemes", {})["bearer"] = BEARER
            schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
