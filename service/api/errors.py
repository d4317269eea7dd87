"""The one place where errors become HTTP answers, shaped as the REST contract says.

    {"error": {"code": "...", "message": "...", "where": "..." | null}}

Domain errors (:mod:`steptally.service.errors`) carry their status and code;
FastAPI's validation errors become 422 ``invalid_payload``, or 400 ``bad_json`` when
the body is not JSON at all; a database that fails to answer in time (a statement,
pool or connect timeout, a lost connection) is 503 ``unavailable``. Every 503 carries
``Retry-After``, and so does every 429; every 401 carries ``WWW-Authenticate: Bearer``.
A value the database refuses as data is 422 ``invalid_payload``; anything else that
fails is 500 ``internal`` JSON, never plain text. Messages and wheres are cut short, so
no answer echoes a whole input. Every error answer is counted in
``steptally_requests_rejected_total{code}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from sqlalchemy import exc as sql_errors
from starlette.exceptions import HTTPException
from starlette.routing import compile_path

from steptally.service.api.schemas import JsonResponse
from steptally.service.errors import RateLimited, ServiceError, Unauthenticated, Unavailable

RETRY_AFTER_S = 5
# an answer never carries more than this of a message or a where: no input is echoed whole
MAX_MESSAGE, MAX_WHERE = 400, 120
# the code of an HTTP error raised by the framework itself (no route, wrong method, a
# body it could not read), each in the contract (docs/api-contract.md, Errors)
HTTP_CODES = {
    400: "bad_json",
    404: "not_found",
    405: "method_not_allowed",
    413: "too_large",
    415: "unsupported_media_type",
}
# what a database that hangs, restarts or is away raises (psycopg's QueryCanceled, the
# statement timeout, is an OperationalError, raised bare from its pipeline mode; the
# pool's timeout is TimeoutError)
DATABASE_AWAY = (
    sql_errors.OperationalError,
    sql_errors.InterfaceError,
    sql_errors.TimeoutError,
    psycopg.OperationalError,
)


def error_response(
    request: Request, status: int, code: str, message: str, where: str | None
) -> JsonResponse:
    telemetry = getattr(request.app.state, "telemetry", None)
    if telemetry is not None:
        telemetry.rejected(code)
    message = message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 1] + "…"
    if where is not None and len(where) > MAX_WHERE:
        where = where[: MAX_WHERE - 1] + "…"
    body = {"error": {"code": code, "message": message, "where": where}}
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JsonResponse(body, status_code=status, headers=headers)


def answer_error(request: Request, exc: ServiceError) -> JsonResponse:
    """The answer to ``exc``: 401 with ``WWW-Authenticate: Bearer``, 429 with ``Retry-After``."""
    response = error_response(request, exc.status, exc.code, exc.message, exc.where)
    if isinstance(exc, Unauthenticated):
        response.headers["WWW-Authenticate"] = exc.challenge
    if isinstance(exc, RateLimited):
        response.headers["Retry-After"] = str(exc.retry_after_s)
    return response


async def _service_error(request: Request, exc: Exception) -> JsonResponse:
    assert isinstance(exc, ServiceError)
    return answer_error(request, exc)


async def _database_away(request: Request, exc: Exception) -> JsonResponse:
    away = Unavailable(f"the database did not answer in time ({type(exc).__name__}); retry")
    return await _service_error(request, away)


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
    status = exc.status_code
    code = HTTP_CODES.get(status, "bad_request" if status < 500 else "internal")
    message = str(exc.detail)
    if status == 400:
        message = "the body could not be read as JSON; send UTF-8 JSON"
    response = error_response(request, status, code, message, None)
    for name, value in (exc.headers or {}).items():
        response.headers[name] = value
    if status == 405:  # every method of the path, not only the first route's (RFC 9110)
        response.headers["Allow"] = ", ".join(_allowed(request))
    return response


def _allowed(request: Request) -> list[str]:
    """The methods the app's OpenAPI description lists for the request's path."""
    methods: set[str] = set()
    for template, operations in request.app.openapi()["paths"].items():
        if compile_path(template)[0].match(request.url.path):
            methods |= {m.upper() for m in operations}
    if "GET" in methods:
        methods.add("HEAD")  # answered wherever GET is
    return sorted(methods)


async def _unstorable(request: Request, exc: Exception) -> JsonResponse:
    """A value the database refused as data (out of range, NUL in text): a 4xx, since
    only input can carry one past the checks."""
    message = (
        "a value in the request cannot be stored (out of range, or a character the "
        "database refuses); check the request against docs/api-contract.md"
    )
    return error_response(request, 422, "invalid_payload", message, None)


async def _internal(request: Request, exc: Exception) -> JsonResponse:
    """Any other failure: 500 JSON, never plain text (the traceback goes to the log)."""
    message = "the service failed on this request; it is logged, and retrying may help"
    return error_response(request, 500, "internal", message, None)


def install(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    for kind in DATABASE_AWAY:
        app.add_exception_handler(kind, _database_away)
    app.add_exception_handler(sql_errors.DataError, _unstorable)
    app.add_exception_handler(psycopg.DataError, _unstorable)
    app.add_exception_handler(Exception, _internal)
