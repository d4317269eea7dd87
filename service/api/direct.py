"""The reporter's request served by the HTTP protocol itself, without an ASGI task.

Under load the event loop is the service's critical path, and an ingest request
through the ASGI lane (``service/api/front.py``) spent ~120 µs of it on the way in and
out alone — uvicorn's request task and its ``receive`` and ``send``, the four
middlewares, their wrappers — against ~55 µs for the work itself: decoding the body,
handing it to the store's writers, writing the answer. :class:`LaneProtocol`, the
service's uvicorn HTTP protocol (``steptally serve``), serves the common request as
plain calls instead: once the body is in, :class:`DirectLane` decodes it, submits it
and returns; when the writer's group has committed, one callback on the event loop
writes the whole answer (status line, headers and body in one write).

The request is the one the ASGI lane takes, and more narrowly what needs no waiting
before the store: ``POST /v1/runs/{run}/fragments`` with a run name of the contract's
pattern and no query but ``partial=false``, a JSON body (or one without a
``Content-Type``), not compressed, with a ``Content-Length`` of at most
:data:`~steptally.service.api.fragments.INLINE_BYTES` and the body limit, no
``Expect``, of a run the process knows, with auth off, room in the body budget and
(with a rate limit) a token left for its address (its address as the connection
gives it: a request with ``X-Forwarded-*`` headers, which the proxy-headers middleware
would read, goes the ASGI way when there is a limit). Everything else — and every
request of a connection whose earlier request is still being answered, but for its
turn — goes to the ASGI app exactly as before, which the checks above leave unchanged:
nothing happens before them that the ASGI lane would not do again. The common request
is recognised from its raw head (:meth:`DirectLane.lean`), before uvicorn parses its
URL into the scope; a head that this cannot tell about is parsed as uvicorn parses it,
and :meth:`DirectLane.takes` decides on the scope.

What the middlewares do for the lane, the direct lane does itself: the rate limit and
the body budget (above), the request deadline (one timer for every request in flight:
past ``request_timeout_s`` without an answer, 503 ``unavailable``, and the batch is left
to its writer as on the ASGI lane) and the request metrics (the route's template, the
status and the time from the body's arrival). An error — a body the store refuses, a
conflict, a database that is away, anything unexpected — is answered by starting
uvicorn's ordinary request task on the same request, with an app that raises the error
inside the app's own exception handlers and request metrics (:func:`error_app`): the
answer, its status, code, message and headers, and the log of an unexpected error are
those of the ASGI lane (``tests/integration/test_direct_lane.py`` compares them byte for
byte).
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any, Protocol, cast

from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from steptally.service.api.deadline import late
from steptally.service.api.deps import RUN_PATTERN
from steptally.service.api.fragments import INLINE_BYTES, IngestLane
from steptally.service.api.front import Answering
from steptally.service.api.instrument import ARRIVED, RequestMetrics, route_template
from steptally.service.api.limits import BodyBudget, is_json
from steptally.service.api.schemas import JsonResponse, json_bytes
from steptally.service.auth.middleware import address_of
from steptally.service.auth.ratelimit import RateLimiter
from steptally.service.errors import ServiceError
from steptally.service.metrics.instruments import Telemetry
from steptally.service.store.protocol import IngestOutcome
from steptally.service.usecase.facade import Service
from steptally.service.usecase.ingest import Prepared

#: after the length, as the ASGI lane's answer has them
_TYPE = b"\r\ncontent-type: " + JsonResponse.media_type.encode() + b"\r\n"
#: the headers that send a request the ASGI way: what only the ASGI path reads
_ELSEWHERE = frozenset((b"content-encoding", b"transfer-encoding", b"expect"))
_FORWARDED = frozenset((b"x-forwarded-for", b"x-forwarded-proto"))
#: the raw request target of the lane's requests that :meth:`DirectLane.lean` reads:
#: the path with no escape (so that it is its own decoding) and the query the lane takes
_LANE_TARGET = re.compile(
    rb"/v1/runs/(" + RUN_PATTERN.strip("^$").encode() + rb")/fragments(?:\?partial=false)?"
)


class Reply(Protocol):
    """How :class:`DirectLane` answers one request: :meth:`ok` with the answer's JSON, or
    :meth:`fail` with an error for the app's handlers to answer (see the module)."""

    def ok(self, body: bytes) -> None: ...

    def fail(self, error: BaseException) -> None: ...


class DirectLane:
    """The ingest lane's common request as plain calls (the module's docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        lane: IngestLane,
        service: Service,
        budget: BodyBudget,
        telemetry: Telemetry,
        limiter: RateLimiter | None,
        max_body_bytes: int,
        timeout_s: float,
    ) -> None:
        self.app = app
        self.lane = lane
        self.service = service
        self.budget = budget
        self.telemetry = telemetry
        self.limiter = limiter
        self.max_bytes = min(INLINE_BYTES, max_body_bytes)
        self.timeout_s = timeout_s
        self.template = route_template({"route": lane.route})  # the metrics' label
        # the requests being served and their deadlines, oldest first (one timeout for
        # all: arrival order is deadline order), and the one timer, at the oldest's
        self._open: dict[Serving, float] = {}
        self._sweep_at: asyncio.TimerHandle | None = None

    def takes(self, scope: Scope) -> bool:
        """Whether the request whose head is ``scope`` is one to serve here."""
        if scope["method"] != "POST" or scope.get("query_string") not in (b"", b"partial=false"):
            return False
        if not self._headers_taken(scope["headers"]):
            return False
        match, child = self.lane.matches(scope)
        if match is not Match.FULL:
            return False
        scope["app"] = self.app
        scope.update(child)
        return True

    def lean(self, url: bytes, headers: list[tuple[bytes, bytes]]) -> str | None:
        """The run of a ``POST`` whose raw target and headers (as uvicorn's protocol
        holds them, names lowercased) :meth:`takes` would take, read from the bytes
        without the scope's path, query and route; None where this cannot tell (a
        target with an escape, say), and :meth:`takes` then decides on the scope."""
        found = _LANE_TARGET.fullmatch(url)
        if found is None or not self._headers_taken(headers):
            return None
        return found[1].decode("ascii")

    def _headers_taken(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether the headers are of a request to serve here: one ``Content-Length``
        within the lane's limit, a JSON type or none, and none that only the ASGI path
        reads."""
        length = -1
        for name, value in headers:
            if name == b"content-length":
                if not value.isdigit() or length >= 0:
                    return False
                length = int(value)
            elif name == b"content-type":
                if not is_json(value.decode("latin-1")):
                    return False
            elif name in _ELSEWHERE or (self.limiter is not None and name in _FORWARDED):
                return False
        return 0 <= length <= self.max_bytes

    def serve(self, scope: Scope, body: bytes, reply: Reply) -> bool:
        """Serve the request whose head ``takes`` took, with its whole ``body``; False:
        nothing was done, the ASGI app serves it."""
        run: str = scope["path_params"]["run"]
        service = self.service
        if not service.runs.cached(run) or not self.budget.try_acquire(len(body)):
            return False
        if self.limiter is not None and self.limiter.take(address_of(scope)) > 0:
            self.budget.release(len(body))
            return False  # the ASGI lane answers 429, from the same bucket
        scope[ARRIVED] = arrived = time.perf_counter()
        Serving(self, scope, run, body, arrived, reply).start()
        return True

    def opened(self, serving: Serving, loop: asyncio.AbstractEventLoop) -> None:
        """``serving`` is answered 503 past the deadline unless :meth:`closed` first: one
        timer for every request in flight, where a timer each cost a request ~2 µs."""
        deadline = loop.time() + self.timeout_s
        self._open[serving] = deadline
        if self._sweep_at is None:
            self._sweep_at = loop.call_at(deadline, self._sweep, loop)

    def closed(self, serving: Serving) -> None:
        self._open.pop(serving, None)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Answer the requests past their deadline; the timer again at the next one's."""
        self._sweep_at = None
        now = loop.time()
        for serving, deadline in list(self._open.items()):
            if deadline > now:
                self._sweep_at = loop.call_at(deadline, self._sweep, loop)
                return
            del self._open[serving]
            serving.expire()


class Serving:
    """One request on the direct lane, from its body to its answer."""

    __slots__ = ("arrived", "body", "done", "lane", "prepared", "reply", "run", "scope")

    def __init__(
        self, lane: DirectLane, scope: Scope, run: str, body: bytes, arrived: float, reply: Reply
    ) -> None:
        self.lane, self.scope, self.run, self.body = lane, scope, run, body
        self.arrived, self.reply = arrived, reply
        self.done = False
        self.prepared: Prepared | None = None

    def start(self) -> None:
        ingest = self.lane.service.ingest
        loop = asyncio.get_running_loop()
        self.lane.opened(self, loop)
        try:
            self.prepared = ingest.prepare(self.run, self.body)
            # answered on this loop with the rest of its group, in one call
            ingest.submit_call(self.prepared, loop, self._settle)
        except Exception as exc:  # answered by the app's handlers
            self._fail(exc)

    def _settle(self, outcome: IngestOutcome | None, error: BaseException | None) -> None:
        if self.done:
            return  # past the deadline: answered already, the batch stored all the same
        assert self.prepared is not None
        ingest = self.lane.service.ingest
        if isinstance(error, ServiceError):
            ingest.refused(self.prepared, error)
            self._fail(error)
            return
        if error is not None or outcome is None:
            self._fail(error or RuntimeError("a batch was answered without an outcome"))
            return
        try:
            answer = json_bytes(ingest.answered(self.prepared, outcome, self.arrived))
        except Exception as exc:
            self._fail(exc)
            return
        self._end()
        seconds = time.perf_counter() - self.arrived
        self.lane.telemetry.request_done("POST", self.lane.template, 200, seconds)
        self.reply.ok(answer)

    def expire(self) -> None:
        if not self.done:
            self._fail(late(self.lane.timeout_s))

    def _fail(self, error: BaseException) -> None:
        self._end()
        self.reply.fail(error)

    def _end(self) -> None:
        self.done = True
        self.lane.closed(self)
        self.lane.budget.release(len(self.body))


def error_app(direct: DirectLane, error: BaseException) -> ASGIApp:
    """An ASGI app that answers ``error`` as the ASGI lane answers it when its handler
    raises it: inside the request metrics by the app's handler for it, or outside them
    by the one for ``Exception`` (and raised again, for the server's log)."""

    async def raising(scope: Scope, receive: Receive, send: Send) -> None:
        raise error

    owner: Any = direct.app
    inner = Answering(raising, owner, unexpected=False)
    return Answering(RequestMetrics(inner, direct.telemetry), owner, unexpected=True)


class LaneProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with :class:`DirectLane` for the requests it takes
    (the app it serves has one when it is a :class:`~steptally.service.api.front.App`
    with its lane open, whatever middleware uvicorn put around it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.direct = direct_of(self.app)
        self._waiting: RequestResponseCycle | None = None  # taken, its body arriving
        self._lean = False  # the request being read was taken by on_headers_complete

    def on_headers_complete(self) -> None:
        """The lane's request read from its raw target and headers (:meth:`DirectLane.lean`),
        its scope filled in as uvicorn fills it (the lane's path is its own decoding)
        with what the lane's route adds, and no URL parsed or route matched; any other
        request, and one that arrives while the connection's earlier one is still being
        answered, uvicorn's way."""
        direct, parser, cycle = self.direct, self.parser, self.cycle
        run = None
        if (
            direct is not None
            and (cycle is None or cycle.response_complete)
            and not self.root_path
            and self.limit_concurrency is None
            and parser.get_method() == b"POST"
            and parser.get_http_version() == "1.1"
            and not parser.should_upgrade()
        ):
            run = direct.lean(self.url, self.headers)
        if run is None:
            super().on_headers_complete()
            return
        assert direct is not None
        path, _, query = self.url.partition(b"?")
        scope: Scope = cast(Scope, self.scope)
        scope["method"] = "POST"
        scope["path"] = path.decode("ascii")
        scope["raw_path"] = path
        scope["query_string"] = query
        scope["app"] = direct.app
        scope["path_params"] = {"run": run}
        scope["route"] = direct.lane.route
        self.cycle = RequestResponseCycle(
            scope=self.scope,
            transport=self.transport,
            flow=self.flow,
            logger=self.logger,
            access_logger=self.access_logger,
            access_log=self.access_log,
            default_headers=self.server_state.default_headers,
            message_event=asyncio.Event(),
            expect_100_continue=False,
            keep_alive=parser.should_keep_alive(),
            on_response=self.on_response_complete,
        )
        self._lean = True

    def on_body(self, body: bytes) -> None:
        if self._lean:
            self.cycle.body += body  # at most the lane's limit (lean checked the length)
        else:
            super().on_body(body)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        direct = self.direct
        if direct is None or app is not self.app or not direct.takes(_scope(cycle)):
            super()._start_asgi_task(cycle, app)
        elif cycle.more_body:
            self._waiting = cycle
        else:
            self._serve(cycle)

    def on_message_complete(self) -> None:
        if self._lean:
            self._lean = False
            self.cycle.more_body = False
            self.cycle.message_event.set()  # for the ASGI app, should it serve the request
            self._serve(self.cycle)
            return
        super().on_message_complete()
        waiting = self._waiting
        if waiting is not None and waiting is self.cycle:
            self._waiting = None
            self._serve(waiting)

    def _serve(self, cycle: RequestResponseCycle) -> None:
        assert self.direct is not None
        reply = CycleReply(self, cycle)
        if not self.direct.serve(_scope(cycle), bytes(cycle.body), reply):
            super()._start_asgi_task(cycle, self.app)


class CycleReply:
    """Answers on a uvicorn request cycle: the answer written whole, or the error by
    uvicorn's own request task on the same cycle (its body still there to read)."""

    __slots__ = ("cycle", "protocol")

    def __init__(self, protocol: LaneProtocol, cycle: RequestResponseCycle) -> None:
        self.protocol = protocol
        self.cycle = cycle

    def ok(self, body: bytes) -> None:
        cycle = self.cycle
        if cycle.disconnected:
            return
        cycle.response_started = True
        head = [STATUS_LINE[200]]
        for name, value in cycle.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-length: ", str(len(body)).encode(), _TYPE]
        if not cycle.keep_alive:
            head.append(b"connection: close\r\n")
        if cycle.access_log:
            scope = cycle.scope
            line = get_client_addr(scope), scope["method"], get_path_with_query_string(scope)
            cycle.access_logger.info('%s - "%s %s HTTP/%s" %d', *line, scope["http_version"], 200)
        cycle.transport.write(b"".join([*head, b"\r\n", body]))
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            cycle.transport.close()
        cycle.on_response()

    def fail(self, error: BaseException) -> None:
        assert self.protocol.direct is not None
        app: Any = error_app(self.protocol.direct, error)
        HttpToolsProtocol._start_asgi_task(self.protocol, self.cycle, app)


def _scope(cycle: RequestResponseCycle) -> Scope:
    return cast(Scope, cycle.scope)


def direct_of(app: Any) -> DirectLane | None:
    """The direct lane of the app uvicorn serves, under its wrappers (each keeps the
    app it wraps as ``app``), if it has one."""
    for _ in range(8):
        direct = getattr(app, "direct", None)
        if isinstance(direct, DirectLane):
            return direct
        app = getattr(app, "app", None)
        if app is None:
            return None
    return None
