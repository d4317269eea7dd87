"""The app factory: ``create_app(settings)`` builds everything, nothing at import time.

The app keeps its objects on ``app.state``:

* ``settings`` — the :class:`~steptally.service.settings.Settings` it was built with;
* ``registry`` — a ``prometheus_client.CollectorRegistry`` of its own (never the global
  one), where ``telemetry`` registers its metrics and a ``/metrics`` route can read;
* ``telemetry`` — :class:`~steptally.service.telemetry.Telemetry`;
* ``store`` — the :class:`~steptally.service.store.base.Store` (SQL today);
* ``service`` — the :class:`~steptally.service.usecase.service.Service` the routers use.

The lifespan checks that the database schema is at head, starts the fan-out of
finalisations over Redis when ``redis_url`` is set (``service/coordination/``) and the
sweeper of overdue steps, and on shutdown stops them and closes the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.concurrency import run_in_threadpool

from steptally.service.api import docs, errors, events, fragments, health, metrics, runs, steps
from steptally.service.api.deadline import RequestDeadline
from steptally.service.api.instrument import RequestMetrics
from steptally.service.auth.middleware import Guard
from steptally.service.auth.wiring import limiter_of, open_tokens
from steptally.service.coordination.fanout import RedisFanout
from steptally.service.coordination.keys import RedisKeys
from steptally.service.coordination.schedule import DeadlineSchedule
from steptally.service.coordination.store import CoordinatedStore
from steptally.service.dashboard import router as dashboard
from steptally.service.exposition import RunValueCollector
from steptally.service.settings import Settings, database_limits
from steptally.service.store.base import Store
from steptally.service.store.schema import check_current
from steptally.service.store.sql import SqlStore
from steptally.service.telemetry import Telemetry
from steptally.service.usecase.events import EventHub
from steptally.service.usecase.service import Service
from steptally.service.usecase.sweeper import sweep_forever


def create_app(
    settings: Settings | None = None,
    *,
    clock: Callable[[], float] = time.time,
    sweep: bool = True,
) -> FastAPI:
    """Build the service. ``clock`` and ``sweep=False`` exist for tests."""
    settings = settings or Settings()
    sql = SqlStore.from_url(
        settings.database_url,
        settings.ingest_group_max_batches,
        settings.ingest_group_max_bytes,
        database_limits(settings),
    )
    store: Store = sql
    if settings.redis_url is not None:  # open steps scheduled in Redis for every replica
        keys = RedisKeys(settings.redis_prefix)
        store = CoordinatedStore(sql, DeadlineSchedule.from_url(settings.redis_url, keys))
    registry = CollectorRegistry(auto_describe=True)
    telemetry = Telemetry(registry)
    registry.register(RunValueCollector(store.exposition_snapshot))
    hub = EventHub()
    fanout = None
    if settings.redis_url is not None:
        fanout = RedisFanout(settings.redis_url, RedisKeys(settings.redis_prefix), hub)
    timeout_s = settings.default_step_timeout_s
    service = Service(store, telemetry, timeout_s, clock, events=hub, publisher=fanout)
    tokens = open_tokens(settings)  # None: auth is off

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = None
        try:
            await run_in_threadpool(check_current, sql.engine, settings.database_url)
            if fanout is not None:
                await fanout.start()
            if sweep:
                task = asyncio.create_task(sweep_forever(service, settings.sweep_interval_s))
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if fanout is not None:
                await fanout.stop()
            service.events.close()
            store.close()
            if tokens is not None:
                tokens.close()

    app = FastAPI(title="Steptally", version="1", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.registry = registry
    app.state.telemetry = telemetry
    app.state.store = store
    app.state.service = service
    errors.install(app)
    app.add_middleware(Guard, tokens=tokens, limiter=limiter_of(settings))  # inside the metrics
    app.add_middleware(RequestDeadline, seconds=settings.request_timeout_s)
    app.add_middleware(RequestMetrics, telemetry=telemetry)
    for module in (runs, fragments, steps, events, health, metrics, docs):
        app.include_router(module.router)
    dashboard.install(app)
    return app
