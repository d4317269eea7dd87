"""Request metrics: an ASGI middleware timing every HTTP request by route template.

The route template (``/v1/runs/{run}/steps/{step}``) is read from the scope after
the router matched it (Starlette records the matched route in ``scope["route"]``),
so the label set stays bounded whatever paths clients send; a request that matched
no route is labelled ``unmatched``. The time runs from the request's arrival to
its response headers: for a JSON answer that is the whole handling, for a stream
(server-sent events) it is the time to the first byte, not the life of the stream.
An exception that escapes the app is recorded as status 500 and re-raised.
"""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from steptally.service.metrics.instruments import Telemetry

UNMATCHED = "unmatched"
#: the scope's key for the ``perf_counter`` of a request's arrival, where it was taken
#: before the metrics were called (``service/api/direct.py``)
ARRIVED = "steptally.arrived"


def route_template(scope: Scope) -> str:
    """The matched route's path template, or ``unmatched``."""
    path = getattr(scope.get("route"), "path", None)
    return path if isinstance(path, str) and path else UNMATCHED


class RequestMetrics:
    """Observes ``steptally_http_request_duration_seconds`` for each HTTP request."""

    def __init__(self, app: ASGIApp, telemetry: Telemetry) -> None:
        self.app = app
        self.telemetry = telemetry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = scope.get(ARRIVED) or time.perf_counter()
        recorded = False

        def record(status: int) -> None:
            nonlocal recorded
            if not recorded:
                recorded = True
                seconds = time.perf_counter() - started
                self.telemetry.request_done(scope["method"], route_template(scope), status, seconds)

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                record(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            record(500)  # nothing was sent: the app raised
