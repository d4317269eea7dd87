"""With auth on, the OpenAPI description declares the bearer token, so ``/docs`` has an
"Authorize" button and its "Try it out" requests carry the token."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

SCHEME = {
    "type": "http",
    "scheme": "bearer",
    "description": "a token from `steptally token create` (docs/security.md)",
}


def declare_bearer(app: FastAPI) -> None:
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {}).setdefault("securitySchemes", {})["bearer"] = SCHEME
            schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
