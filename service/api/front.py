"""The app's front door: the reporter's requests by a short chain, the rest by FastAPI.

FastAPI serves a request through a dozen layers before a route sees it: its own
telemetry check, Starlette's error and exception middlewares, a body limit, an exit
stack, the router — and the app's four middlewares among them. For ``GET /v1/runs``
that is nothing; for the request a training job sends thousands of times a second it
was a tenth of the event loop's time. :class:`App` serves that one request — the
ingest lane's (:class:`~steptally.service.api.fragments.IngestLane`: ``POST
/v1/runs/{run}/fragments`` with a run name of the contract's pattern) — through the
same four middlewares, built from the same list and sharing their state (the rate
limiter's buckets, the telemetry), around the lane, and answers what the lane raises
with the same exception handlers, as Starlette's middlewares would:

* an error the app has a handler for (a :class:`~steptally.service.errors.ServiceError`,
  an ``HTTPException``, a database that is away) is answered inside the middlewares,
  so the request metrics see its status, as :class:`ExceptionMiddleware` answers it;
* anything else is answered outside them by the handler for ``Exception`` (500
  ``internal``) and raised again for the server's log, as
  :class:`ServerErrorMiddleware` does.

Every other request — another route, another query, a run name the lane does not
take — goes to FastAPI as before, so ``/openapi.json`` and the general route are
unchanged; ``tests/integration/test_ingest_lane.py`` sends the same requests through
both doors and asserts the same answers, byte for byte.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.routing import Match
from starlette.types import ASGIApp, HTTPExceptionHandler, Receive, Scope, Send

from steptally.service.api.deadline import AnswerWatch
from steptally.service.api.fragments import IngestLane

if TYPE_CHECKING:  # direct.py builds on this module
    from steptally.service.api.direct import DirectLane


class App(FastAPI):
    """FastAPI with the ingest lane in front; :meth:`serve_lane` opens it."""

    lane: IngestLane | None = None
    #: the lane's common request served by the HTTP protocol (``service/api/direct.py``)
    direct: DirectLane | None = None
    _lane_chain: ASGIApp | None = None

    def serve_lane(self, lane: IngestLane, layers: Sequence[Middleware]) -> None:
        """Serve ``lane``'s requests through ``layers`` (innermost first, as added with
        ``add_middleware``), ahead of FastAPI's own."""
        chain: ASGIApp = Answering(self._handle, self, unexpected=False)
        for layer in layers:
            chain = layer.cls(chain, *layer.args, **layer.kwargs)
        self.lane = lane
        self._lane_chain = Answering(chain, self, unexpected=True)

    def close_lane(self) -> None:
        """Send every request through FastAPI again (what the lane is checked against)."""
        self.lane = self._lane_chain = self.direct = None

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.lane is not None
        await self.lane.handle(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lane, chain = self.lane, self._lane_chain
        if lane is not None and chain is not None and scope["type"] == "http":
            match, child = lane.matches(scope)
            if match is Match.FULL:
                scope["app"] = self
                scope.update(child)
                await chain(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


class Answering:
    """Answers an exception ``app`` raises with ``owner``'s handler for it.

    ``unexpected`` False: the errors ``owner`` has a handler for other than
    ``Exception``; an error after the answer started is raised as it is.
    ``unexpected`` True: anything, with the handler for ``Exception``, then raised again
    (for the server's log); after the answer started, only raised.
    """

    def __init__(self, app: ASGIApp, owner: FastAPI, unexpected: bool) -> None:
        self.app = app
        self.owner = owner
        self.unexpected = unexpected

    def _handler(self, exc: Exception) -> HTTPExceptionHandler | None:
        handlers = self.owner.exception_handlers
        if self.unexpected:
            return handlers.get(Exception) or handlers.get(500)
        if isinstance(exc, HTTPException) and exc.status_code in handlers:
            return handlers[exc.status_code]
        for kind in type(exc).__mro__:
            if kind is Exception:
                return None
            if kind in handlers:
                return handlers[kind]
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watched = AnswerWatch(send)
        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            handler = self._handler(exc)
            if handler is None or watched.started:
                raise
            answer = handler(Request(scope, receive), exc)
            if inspect.isawaitable(answer):
                answer = await answer
            await answer(scope, receive, send)
            if self.unexpected:
                raise
