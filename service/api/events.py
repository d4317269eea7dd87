"""``GET /v1/runs/{run}/events``: finalisations as server-sent events.

Each event is ``event: step``, ``id: <cursor>``, ``data: <the step object>``; a
``Last-Event-ID`` header (or ``?last_event_id=``) replays what came after it, then
the stream goes on live. The run and the cursor are checked before the stream
starts, so a bad request is an ordinary JSON error. The first thing sent is the
comment ``: live`` with an ``id:`` and no data: from then on no finalisation is missed,
and a client that reconnects with that id (or a later event's) receives every step
finalised meanwhile. The id is the client's own ``Last-Event-ID`` when it sent one, else
the place after every finalisation stored when the stream began. So a stream that ends
before its first event (Redis lost, a replica stopped) still leaves the client an id to
resume from; a browser's ``EventSource`` keeps it (the HTML standard sets the last event
id even for an event without data) and reconnects after ``RETRY_MS``. Comments keep the connection
alive every ``PING_S`` seconds. When the server begins to shut down, sse-starlette
tells the stream, which ends cleanly (its last chunk sent, so uvicorn never waits on
it); the hub ends any stream still open when the app stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import anyio
import orjson
from fastapi import APIRouter, Header, Query
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool

from steptally.service.api.deps import EVENT_ID_PATTERN, RunName, ServiceDep
from steptally.service.api.schemas import errors
from steptally.service.domain.run import RunRecord
from steptally.service.usecase.events import EventCursor, StepEvent, step_events
from steptally.service.usecase.facade import Service

router = APIRouter(prefix="/v1/runs", tags=["events"])

PING_S = 15
RETRY_MS = 1000  # how soon an EventSource reconnects to a stream that ended
SHUTDOWN_GRACE_S = 2.0  # for a replay in progress to reach a clean end


async def _sse(
    service: Service, run: RunRecord, after: EventCursor | None, shutdown: anyio.Event
) -> AsyncIterator[ServerSentEvent | bytes]:
    """Subscribe, say so in a comment (the stream is live from here), then the events;
    the stream ends (completely sent) when the server begins to shut down."""
    sub = service.events.subscribe(run.name)

    async def end_on_shutdown() -> None:
        await shutdown.wait()
        sub.end()

    watcher = asyncio.create_task(end_on_shutdown())
    try:
        start = after if after is not None else await run_in_threadpool(service.newest_cursor, run)
        yield ServerSentEvent(comment="live", id=start.encode(), retry=RETRY_MS)
        async for event in step_events(service, run, after, sub, start):
            yield wire(event)
    finally:
        watcher.cancel()
        sub.close()


def wire(event: StepEvent) -> bytes:
    """``event`` as a stream sends it: ``id``, ``event: step`` and the step object as
    JSON, encoded by the first stream that sends it and kept on the event for every
    other stream of the run (an event of 32 metrics cost each stream ~30 µs of CPU to
    encode again: ``bench/event_cost.py``)."""
    if not event.wire:
        data = orjson.dumps(event.step, option=orjson.OPT_NON_STR_KEYS).decode()
        sse = ServerSentEvent(data=data, event="step", id=event.cursor.encode())
        event.wire.append(sse.encode())
    return event.wire[0]


@router.get(
    "/{run}/events",
    response_class=EventSourceResponse,
    responses=errors(404, 422, also={200: {"content": {"text/event-stream": {}}}}),
)
async def run_events(
    run: RunName,
    service: ServiceDep,
    # typed str with a None default, so that the schema says "a string" (with its
    # pattern) and no null, which a header or a query cannot carry
    last_event_id: str = Query(default=None, pattern=EVENT_ID_PATTERN),
    last_event_id_header: str = Header(
        default=None, alias="Last-Event-ID", pattern=EVENT_ID_PATTERN
    ),
) -> EventSourceResponse:
    text, where = last_event_id_header, "header.Last-Event-ID"
    if text is None:
        text, where = last_event_id, "query.last_event_id"
    record, after = await run_in_threadpool(service.open_events, run, text, where)
    shutdown = anyio.Event()
    return EventSourceResponse(
        _sse(service, record, after, shutdown),
        ping=PING_S,
        shutdown_event=shutdown,
        shutdown_grace_period=SHUTDOWN_GRACE_S,
    )
