"""The service facade the routers and the sweeper use: one per app, on ``app.state.service``.

The sweeper (:func:`sweep_forever`) finalises overdue open steps as partial,
periodically: it runs as an asyncio task in the app's lifespan and does its database
work in the thread pool. Several instances may sweep one database: the store's row
lock makes each finalisation happen once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from starlette.concurrency import run_in_threadpool

from steptally.service.auth.grant import Grant
from steptally.service.domain.run import RunRecord
from steptally.service.metrics.instruments import Telemetry
from steptally.service.store.protocol import FinalisedStep, StepRecord, Store
from steptally.service.usecase import query
from steptally.service.usecase.events import EventCursor, EventHub, EventPublisher, StepEvent
from steptally.service.usecase.ingest import Ingest
from steptally.service.usecase.registration import RunDirectory, RunRequest, register

log = logging.getLogger(__name__)


class Service:
    """Use cases bound to one store, telemetry and clock."""

    def __init__(
        self,
        store: Store,
        telemetry: Telemetry,
        default_step_timeout_s: float,
        clock: Callable[[], float] = time.time,
        events: EventHub | None = None,
        publisher: EventPublisher | None = None,
        announce: Callable[[], None] | None = None,
    ) -> None:
        """``events``: this process's hub; ``publisher``: where finalisations go (the
        hub itself unless a fan-out to other replicas is given); ``announce``: called
        once committed finalisations are published, to tell the processes that do not
        hear them otherwise (``steptally serve --workers N`` without Redis)."""
        self.store = store
        self.telemetry = telemetry
        self.clock = clock
        self.default_step_timeout_s = default_step_timeout_s
        self.runs = RunDirectory(store)
        self.events = events or EventHub()
        self.publisher: EventPublisher = publisher or self.events
        self.announce = announce
        self.ingest = Ingest(store, self.runs, telemetry, clock, self._published)

    def ready(self) -> None:
        """Raise unless the store can serve (``NotMigrated`` when its schema is not at head)."""
        self.store.check_ready()

    def register_run(
        self, request: RunRequest, grant: Grant = Grant.ANY
    ) -> tuple[dict[str, Any], bool]:
        run, created = register(
            store=self.store,
            request=request,
            default_timeout_s=self.default_step_timeout_s,
            now=self.clock(),
            grant=grant,
        )
        self.runs.put(run)
        summary = self.store.run_summary(run.name)
        assert summary is not None
        return query.run_json(summary), created

    def get_run(self, name: str) -> dict[str, Any]:
        return query.get_run(self.store, name)

    def list_runs(self, limit: int = 100, cursor: str | None = None) -> dict[str, Any]:
        return query.list_runs(self.store, limit, cursor)

    def get_step(self, run: str, step: int) -> dict[str, Any]:
        return query.get_step(self.store, self.runs.get(run, refresh=True), step)

    def list_steps(
        self,
        run: str,
        start: int | None = None,
        end: int | None = None,
        metrics: Sequence[str] = (),
        limit: int = 100,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        record = self.runs.get(run, refresh=True)
        return query.list_steps(self.store, record, start, end, metrics, limit, cursor)

    def series(
        self,
        run: str,
        metric: str,
        start: int | None = None,
        end: int | None = None,
        points: int | None = None,
    ) -> dict[str, Any]:
        record = self.runs.get(run, refresh=True)
        return query.series(self.store, record, metric, start, end, points)

    def list_breaches(
        self,
        run: str,
        start: int | None = None,
        end: int | None = None,
        rules: Sequence[str] = (),
        limit: int = 100,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        record = self.runs.get(run, refresh=True)
        return query.list_breaches(self.store, record, start, end, rules, limit, cursor)

    def sweep(self, now: float | None = None) -> list[FinalisedStep]:
        """Finalise as partial every open step past its deadline."""
        started = time.perf_counter()
        done = self.store.sweep(self.clock() if now is None else now)
        self.telemetry.steps_done(done, time.perf_counter() - started)
        self._published(done)
        return done

    def open_events(self, run: str, last_event_id: str | None, where: str) -> OpenedEvents:
        """The run and the cursor to replay after (None: live only); raises 404 / 422."""
        record = self.runs.get(run, refresh=True)
        after = None if last_event_id is None else EventCursor.decode(last_event_id, where)
        return record, after

    def newest_cursor(self, run: RunRecord) -> EventCursor:
        """Where a stream that starts live stands: after every finalisation stored now
        (the origin before the run's first)."""
        newest = self.store.newest_finalised(run)
        return EventCursor(0.0, 0, 0) if newest is None else EventCursor(*newest)

    def replay(self, run: RunRecord, after: EventCursor, limit: int) -> list[StepEvent]:
        records = self.store.finalised_since(run, after.place(), limit)
        return [_event(run, r) for r in records]

    def _published(self, finalised: Sequence[FinalisedStep]) -> None:
        """Hand the committed finalisations to the event streams listening."""
        by_run: dict[str, list[StepEvent]] = {}
        for f in finalised:
            if f.run_record is not None and f.record is not None and self.publisher.wants(f.run):
                by_run.setdefault(f.run, []).append(_event(f.run_record, f.record))
        for run, events in by_run.items():
            self.publisher.publish(run, events)
        if finalised and self.announce is not None:
            self.announce()


OpenedEvents = tuple[RunRecord, EventCursor | None]


def _event(run: RunRecord, record: StepRecord) -> StepEvent:
    assert record.finalised_at is not None
    cursor = EventCursor(record.finalised_at, record.step, record.revision)
    return StepEvent(cursor, query.step_json(run, record))


async def sweep_forever(service: Service, interval_s: float) -> None:
    """Sweep every ``interval_s`` seconds until cancelled; errors are logged, not fatal."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await run_in_threadpool(service.sweep)
        except Exception:  # a database hiccup must not stop the sweeper for good
            log.exception("sweeping overdue steps failed; retrying in %.1fs", interval_s)
