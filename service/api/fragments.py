"""``POST /v1/runs/{run}/fragments``: the ingest route.

The body is read here (size limit, gzip) and decoded and checked (on the event loop
when it is small, else on a worker thread); the store's writer threads store it with
the next group while the request waits on the event loop, and the answer is sent only
after the commit.
``?partial=true`` stores what is right and lists the wrong items in ``rejected``.

Two doors lead to the same work (:func:`ingest`). :class:`IngestLane`, which the app
serves ahead of FastAPI (``service/api/front.py``), takes the requests the reporter
sends — a run name that matches the contract's pattern, no query or
``partial=true|false`` — and serves them as plain ASGI: no dependency solving, no
parameter models, the answer's bytes sent as they are. Anything else (a run name
that does not match, another query) goes on to the FastAPI route below, which
validates it as before and is the one ``/openapi.json`` documents. Errors are raised,
not answered, on both doors, so the app's exception handlers
(``service/api/errors.py``) answer them alike.
"""

from __future__ import annotations

import asyncio
import re
import time

from fastapi import APIRouter, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import Receive, Scope, Send

from steptally.service.api.body import decode_content, inflated_size, read_limited
from steptally.service.api.deps import RUN_PATTERN, RunName
from steptally.service.api.handoff import Handoff
from steptally.service.api.limits import BodyBudget
from steptally.service.api.schemas import IngestAnswer, JsonResponse, errors, json_bytes
from steptally.service.errors import ServiceError
from steptally.service.settings import Settings
from steptally.service.store.protocol import IngestOutcome
from steptally.service.usecase.facade import Service
from steptally.service.usecase.ingest import Ingest, Prepared

PATH = "/v1/runs/{run}/fragments"
#: a body of at most this many bytes (uncompressed) is decoded on the event loop:
#: ~100 µs for the reporter's 8 × 32 values, less than a hand-off to a worker thread
INLINE_BYTES = 64 * 1024

router = APIRouter(prefix="/v1/runs", tags=["fragments"])


@router.post(
    "/{run}/fragments",
    response_model=IngestAnswer,
    responses=errors(400, 404, 409, 413, 415, 422, 503),
)
async def post_fragments(run: RunName, request: Request, partial: bool = False) -> Response:
    return Response(await ingest(request, run, partial), media_type=JsonResponse.media_type)


async def ingest(request: Request, run: str, partial: bool) -> bytes:
    """Store the body of ``request`` in ``run``; the answer's JSON once it is durable."""
    arrived = time.perf_counter()
    state = request.app.state
    settings: Settings = state.settings
    service: Service = state.service
    budget: BodyBudget = state.body_budget
    handoff: Handoff = state.handoff
    limit = settings.max_body_bytes
    declared = request.headers.get("content-length", "")
    held = min(limit, int(declared)) if declared.isdigit() else limit
    await budget.acquire(held)  # the raw bytes before they are read
    try:
        raw = await read_limited(request, limit)
        encoding = request.headers.get("content-encoding")
        inflated = inflated_size(raw, encoding, limit)
        if inflated:  # let go and take raw plus inflated at once: no two wait on each other
            budget.release(held)
            held = 0
            await budget.acquire(len(raw) + inflated)
            held = len(raw) + inflated

        if partial:  # stored, refused items left out, again: all of it on a worker thread

            def handle() -> bytes:
                body = decode_content(raw, encoding, limit, inflated)
                return json_bytes(service.ingest(run, body, arrived, partial))

            return await handoff.run(handle)

        def prepare() -> Prepared:
            return service.ingest.prepare(run, decode_content(raw, encoding, limit, inflated))

        # a small body of a run known here is decoded on the event loop (a hand-off costs
        # more than it); a large or compressed one, or one whose run has to be read from
        # the store, on a worker thread, so that the loop never waits
        small = not inflated and len(raw) <= INLINE_BYTES and service.runs.cached(run)
        prepared = prepare() if small else await handoff.run(prepare)
        try:  # a deadline that cancels this wait leaves the batch to its writer
            outcome = await _stored(service.ingest, prepared)
        except ServiceError as exc:
            service.ingest.refused(prepared, exc)
            raise
        return json_bytes(service.ingest.answered(prepared, outcome, arrived))
    finally:
        budget.release(held)


def _stored(ingest: Ingest, prepared: Prepared) -> asyncio.Future[IngestOutcome]:
    """The outcome of ``prepared`` once its group committed, answered on this event loop
    (:meth:`~steptally.service.usecase.ingest.Ingest.submit_call`: on PostgreSQL the loop
    may write the group itself). A waiter that is cancelled (the request deadline)
    cancels only this future: the batch goes on to its end with its writer."""
    loop = asyncio.get_running_loop()
    waiting: asyncio.Future[IngestOutcome] = loop.create_future()

    def answer(outcome: IngestOutcome | None, error: BaseException | None) -> None:
        if waiting.cancelled():
            return
        if error is not None:
            waiting.set_exception(error)
        else:
            assert outcome is not None
            waiting.set_result(outcome)

    ingest.submit_call(prepared, loop, answer)
    return waiting


_LANE_PATH = re.compile(r"/v1/runs/(" + RUN_PATTERN.strip("^$") + r")/fragments")
_LANE_QUERY = {b"": False, b"partial=true": True, b"partial=false": False}
_ANSWER_TYPE = (b"content-type", JsonResponse.media_type.encode())


class IngestLane(BaseRoute):
    """The ingest route's requests whose parameters need no validation, as plain ASGI.

    It matches nothing else, so every other request goes on to the routes after it;
    ``route`` (the FastAPI route of the same path) is what the request's scope names
    as its route, for the request metrics.
    """

    def __init__(self, route: BaseRoute) -> None:
        self.route = route
        self.path = PATH
        self.path_format = PATH
        self.include_in_schema = False

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path"):
            return Match.NONE, {}
        partial = _LANE_QUERY.get(scope.get("query_string", b""))
        found = _LANE_PATH.fullmatch(scope["path"])
        if found is None or partial is None:
            return Match.NONE, {}
        return Match.FULL, {"path_params": {"run": found[1]}, "route": self.route}

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        partial = _LANE_QUERY[scope.get("query_string", b"")]
        request = Request(scope, receive)
        body = await ingest(request, scope["path_params"]["run"], partial)
        length = (b"content-length", str(len(body)).encode())
        headers = [length, _ANSWER_TYPE]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def lane(routes: list[BaseRoute]) -> IngestLane:
    """The lane of the FastAPI route of ``PATH`` among ``routes``."""
    for route in routes:
        if getattr(route, "path", None) == PATH:
            return IngestLane(route)
    raise LookupError(f"no route {PATH}")
