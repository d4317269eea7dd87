"""Finalisation events: an in-process hub from the finalising threads to event streams.

The :class:`~steptally.service.usecase.facade.Service` publishes one
:class:`StepEvent` per finalisation (each step and each revision) once its
transaction has committed, from whatever thread ingested or swept; each open stream
holds a :class:`Subscription`, an asyncio queue on the stream's event loop, fed
through ``call_soon_threadsafe``. A stream whose client falls more than
``MAX_QUEUED`` events behind is ended (``lost``), so a slow client never holds
memory unbounded: it reconnects with its last event id and replays from the database.

An :class:`EventCursor` orders finalisations by ``(finalised_at, step)``: a step
finalised again gets a new ``finalised_at`` and so a later place. The hub knows only
this process's finalisations; :func:`step_events` replays from the database first.

A hub fed by other replicas too (the Redis fan-out) is ``degraded`` while that feed is
away: it hears only this replica's finalisations, so a stream that sent them as they
came would give its client an id past the other replicas' steps, which a reconnect
would then never replay. A degraded stream sends nothing from the hub: each
finalisation here, and every ``POLL_S`` at the latest, it reads what the database holds
after its last event, so its ids stay in the database's order and nothing is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.concurrency import run_in_threadpool

from steptally.service.domain.run import RunRecord
from steptally.service.errors import InvalidPayload

MAX_QUEUED = 10_000
POLL_S = 0.5  # a degraded stream reads the database at least this often
RECENT = 10_000  # the (step, revision) pairs a stream remembers having sent


@dataclass(frozen=True, order=True, slots=True)
class EventCursor:
    """Where a finalisation stands in the order of events; opaque to clients."""

    finalised_at: float
    step: int
    revision: int

    def encode(self) -> str:
        return f"{self.finalised_at!r}:{self.step}:{self.revision}"

    @classmethod
    def decode(cls, text: str, where: str) -> EventCursor:
        try:
            at, step, revision = text.split(":")
            cursor = cls(float(at), int(step), int(revision))
        except ValueError:
            cursor = None
        if cursor is None or not (cursor.finalised_at >= 0 and cursor.step >= 0):
            raise InvalidPayload(
                f"{text!r:.40} is not an event id of this stream; reconnect without one", where
            )
        return cursor

    def place(self) -> tuple[float, int]:
        """The key that orders events (the revision only tells them apart)."""
        return self.finalised_at, self.step


@dataclass(frozen=True, slots=True)
class StepEvent:
    cursor: EventCursor
    step: dict[str, Any]  # the step object, as GET /v1/runs/{run}/steps/{step}
    #: the event's bytes as a stream sends them, made once by the first stream that
    #: sends it and shared by the others (``service/api/events.py``)
    wire: list[bytes] = field(default_factory=list, compare=False, repr=False)


class Subscription:
    """One stream's queue of events of one run; ``None`` from :meth:`next` ends it."""

    def __init__(self, hub: EventHub, run: str, loop: asyncio.AbstractEventLoop) -> None:
        self.run = run
        self.lost = False  # the client fell too far behind: end the stream
        self._hub = hub
        self._loop = loop
        self._queue: asyncio.Queue[StepEvent | None] = asyncio.Queue()

    async def next(self) -> StepEvent | None:
        if self.lost:
            return None
        return await self._queue.get()

    def close(self) -> None:
        self._hub.unsubscribe(self)

    def drain(self) -> bool:
        """Drop whatever is queued, from the stream's own event loop (a degraded stream
        reads the database once for all of it); False: the stream's end was in it."""
        ended = False
        while not self._queue.empty():
            ended = self._queue.get_nowait() is None or ended
        return not ended

    def end(self) -> None:
        """End the stream, from its own event loop."""
        self._queue.put_nowait(None)

    def deliver(self, event: StepEvent | None) -> None:
        """Queue ``event`` from any thread (None: the hub is closing)."""
        with contextlib.suppress(RuntimeError):  # the loop has already closed
            self._loop.call_soon_threadsafe(self._put, event)

    def _put(self, event: StepEvent | None) -> None:
        if event is not None and self._queue.qsize() >= MAX_QUEUED:
            self.lost = True
            event = None
        self._queue.put_nowait(event)


class EventHub:
    """Subscriptions by run name; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subs: dict[str, set[Subscription]] = {}
        self._closed = False
        self.degraded = False  # it hears only part of the finalisations (see above)

    def subscribe(self, run: str) -> Subscription:
        """A new subscription to ``run``, delivering on the running event loop."""
        sub = Subscription(self, run, asyncio.get_running_loop())
        with self._lock:
            if self._closed:
                sub.deliver(None)
            else:
                self._subs.setdefault(run, set()).add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            subs = self._subs.get(sub.run)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[sub.run]

    def wants(self, run: str) -> bool:
        """Whether anyone listens to ``run`` (so an event is worth building)."""
        return run in self._subs

    def publish(self, run: str, events: list[StepEvent]) -> None:
        with self._lock:
            subs = list(self._subs.get(run, ()))
        for sub in subs:
            for event in events:
                sub.deliver(event)

    def wake(self) -> None:
        """Another process finalised a step: every degraded stream reads the database
        now rather than at its next poll (nothing to do for one that is not)."""
        if self.degraded:
            self._deliver_all(_WAKE)

    def end_streams(self) -> None:
        """End every open stream, the hub staying open: their clients reconnect with
        their last event id and replay from the database (events may have been missed)."""
        self._deliver_all(None)

    def close(self) -> None:
        """End every stream (the app is shutting down)."""
        with self._lock:
            self._closed = True
        self._deliver_all(None, forget=True)

    def _deliver_all(self, event: StepEvent | None, forget: bool = False) -> None:
        """``event`` to every subscription (``forget``: and drop them all)."""
        with self._lock:
            subs = [s for group in self._subs.values() for s in group]
            if forget:
                self._subs.clear()
        for sub in subs:
            sub.deliver(event)


REPLAY_PAGE = 500
_RACE_S = 60.0  # a transaction in flight at subscription finalised at most this long before


class EventPublisher(Protocol):
    """Where the service hands committed finalisations: the hub itself, or a fan-out
    to every replica's hub (:mod:`steptally.service.coordination.fanout`)."""

    def wants(self, run: str) -> bool: ...

    def publish(self, run: str, events: list[StepEvent]) -> None: ...


class EventSource(Protocol):
    """What a stream needs of the service: the hub, replay pages and a clock."""

    events: EventHub
    clock: Callable[[], float]

    def replay(self, run: RunRecord, after: EventCursor, limit: int) -> list[StepEvent]: ...


async def step_events(
    source: EventSource,
    run: RunRecord,
    after: EventCursor | None,
    sub: Subscription,
    start: EventCursor | None = None,
) -> AsyncIterator[StepEvent]:
    """Every finalisation after ``after`` from the database, then the live ones that
    ``sub`` (subscribed before this starts) receives, each once (``after`` None: live
    only, from ``start``, where the database stood at subscription); ends when the hub
    closes or the client fell too far behind. While the hub is degraded the live ones
    are read from the database instead (see the module's docstring)."""
    since = source.clock() - _RACE_S
    sent: dict[tuple[int, int], None] = {}  # recent (step, revision), oldest first
    position = after if after is not None else start

    def fresh(event: StepEvent) -> bool:
        key = (event.cursor.step, event.cursor.revision)
        if key in sent:
            return False
        if event.cursor.finalised_at >= since:
            sent[key] = None
            if len(sent) > RECENT:
                del sent[next(iter(sent))]
        return True

    async def from_database() -> AsyncIterator[StepEvent]:
        nonlocal position
        while position is not None:
            page = await run_in_threadpool(source.replay, run, position, REPLAY_PAGE)
            for event in page:
                if fresh(event):
                    yield event
            if page:
                position = max(position, page[-1].cursor)
            if len(page) < REPLAY_PAGE:
                return

    if after is not None:
        async for event in from_database():
            yield event
    while True:
        if source.events.degraded and position is not None:
            try:
                woken = await asyncio.wait_for(sub.next(), POLL_S)
            except TimeoutError:
                woken = _WAKE
            if woken is None or not sub.drain():  # one read for every wake queued
                return
            async for event in from_database():
                yield event
            continue
        live = await sub.next()
        if live is None:
            return
        if fresh(live):
            if position is not None:
                position = max(position, live.cursor)
            yield live


_WAKE = StepEvent(EventCursor(0.0, 0, 0), {})  # a poll's time came: read the database
