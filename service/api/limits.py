"""Limits every request meets before any work is done on it.

:class:`RequestLimits` (ASGI middleware) answers, before a route runs:

* 415 ``unsupported_media_type`` to a POST whose ``Content-Type`` is not JSON
  (``application/json`` or ``application/*+json``; a body without one is read as
  JSON): this also stops a cross-site form POST, which always names its type
  (``text/plain``, a form encoding);
* 413 ``too_large`` to a body past its route's limit, by ``Content-Length`` before
  reading, or as soon as the stream passes it: ``max_spec_body_bytes`` for
  ``POST /v1/runs``, ``max_body_bytes`` for fragments, ``max_other_body_bytes`` for
  every other route.

:class:`BodyBudget` bounds the bytes of fragment bodies being decoded at once in a
process, so the memory a burst of large bodies takes is bounded too.
"""

from __future__ import annotations

import re
import threading
import time

import anyio
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from steptally.service.api.errors import error_response
from steptally.service.errors import Unavailable
from steptally.service.settings import Settings

_FRAGMENTS = re.compile(r"/v1/runs/[^/]+/fragments")
_WITH_BODY = {"POST", "PUT", "PATCH"}


def is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def body_limit(settings: Settings, method: str, path: str) -> tuple[int, str]:
    """The byte limit of a route's body and the setting that raises it."""
    if method == "POST" and path == "/v1/runs":
        return settings.max_spec_body_bytes, "STEPTALLY_MAX_SPEC_BODY_BYTES"
    if method == "POST" and _FRAGMENTS.fullmatch(path):
        return settings.max_body_bytes, "STEPTALLY_MAX_BODY_BYTES"
    return settings.max_other_body_bytes, "STEPTALLY_MAX_OTHER_BODY_BYTES"


def _too_large(limit: int, setting: str) -> str:
    return f"the body is larger than the limit of {limit} bytes for this route ({setting})"


class RequestLimits:
    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if method in _WITH_BODY and path.startswith("/v1/"):
            content_type = headers.get(b"content-type")
            if content_type is not None and not is_json(content_type.decode("latin-1")):
                message = "this route takes JSON: send Content-Type: application/json"
                await self._refuse(scope, receive, send, 415, "unsupported_media_type", message)
                return
        limit, setting = body_limit(self.settings, method, path)
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, receive, send, 413, "too_large", _too_large(limit, setting))
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise HTTPException(413, _too_large(limit, setting))
            return message

        await self.app(scope, limited, send)

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, status: int, code: str, message: str
    ) -> None:
        request = Request(scope, receive)
        await error_response(request, status, code, message, None)(scope, receive, send)


class BodyBudget:
    """At most ``capacity`` bytes held at once; one request alone may hold more."""

    def __init__(self, capacity: int, wait_s: float) -> None:
        self.capacity = capacity
        self.wait_s = wait_s
        self.held = 0
        self._lock = threading.Lock()

    def try_acquire(self, n: int) -> bool:
        """Hold ``n`` bytes if there is room now."""
        with self._lock:
            if self.held and self.held + n > self.capacity:
                return False
            self.held += n
            return True

    async def acquire(self, n: int) -> None:
        """Hold ``n`` bytes, waiting up to ``wait_s`` for room; else 503 unavailable."""
        deadline = time.monotonic() + self.wait_s
        while not self.try_acquire(n):
            if time.monotonic() > deadline:
                raise Unavailable(
                    "the service is decoding as many bodies as it may at once "
                    "(STEPTALLY_MAX_INFLIGHT_BODY_BYTES); retry"
                )
            await anyio.sleep(0.01)

    def release(self, n: int) -> None:
        with self._lock:
            self.held -= n
