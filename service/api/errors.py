"""The one place where errors become HTTP answers, shaped as the REST contract says.

    {"error": {"code": "...", "message": "...", "where": "..." | null}}

Domain errors (:mod:`steptally.service.errors`) carry their status and code;
FastAPI's validation errors become 422 ``invalid_payload``, or 400 ``bad_json`` when
the body is not JSON at all. Every error answer is counted in
``steptally_requests_rejected_total{code}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from steptally.service.api.response import JsonResponse
from steptally.service.errors import ServiceError


def error_response(
    request: Request, status: int, code: str, message: str, where: str | None
) -> JsonResponse:
    telemetry = getattr(request.app.state, "telemetry", None)
    if telemetry is not None:
        telemetry.rejected(code)
    body = {"error": {"code": code, "message": message, "where": where}}
    return JsonResponse(body, status_code=status)


async def _service_error(request: Request, exc: Exception) -> JsonResponse:
    assert isinstance(exc, ServiceError)
    return error_response(request, exc.status, exc.code, exc.message, exc.where)


def _location(loc: Sequence[Any]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or None


async def _validation_error(request: Request, exc: Exception) -> JsonResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return error_response(request, 400, "bad_json", "the body is not valid JSON", None)
    where = _location(first.get("loc", ()))
    message = f"{first.get('msg', 'invalid value')}" + (f" at {where}" if where else "")
    return error_response(request, 422, "invalid_payload", message, where)


async def _http_error(request: Request, exc: Exception) -> JsonResponse:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error_response(request, exc.status_code, code, str(exc.detail), None)


def install(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
