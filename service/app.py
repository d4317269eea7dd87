"""The app factory: ``create_app(settings)`` builds everything, nothing at import time.

The app keeps its objects on ``app.state``:

* ``settings`` — the :class:`~steptally.service.settings.Settings` it was built with;
* ``registry`` — a ``prometheus_client.CollectorRegistry`` of its own (never the global
  one), where ``telemetry`` registers its metrics and a ``/metrics`` route can read;
* ``telemetry`` — :class:`~steptally.service.metrics.instruments.Telemetry`;
* ``store`` — the :class:`~steptally.service.store.protocol.Store`, given or opened from
  the settings by :func:`~steptally.service.store.factory.open_store`;
* ``service`` — the :class:`~steptally.service.usecase.facade.Service` the routers use;
* ``handoff`` — the :class:`~steptally.service.api.handoff.Handoff` to the worker threads
  of the ingest route (stopped at shutdown).

The lifespan checks that the store is ready (its database schema at head), starts the fan-out of
finalisations over Redis when ``redis_url`` is set (``service/coordination/``) and the
sweeper of overdue steps, and on shutdown stops them and closes the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI
from sqlalchemy.engine import make_url
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware

from steptally.service.api import docs, errors, events, fragments, health, runs, steps
from steptally.service.api.deadline import RequestDeadline
from steptally.service.api.direct import DirectLane
from steptally.service.api.docs import declare_bearer, describe_limits
from steptally.service.api.front import App
from steptally.service.api.handoff import Handoff
from steptally.service.api.instrument import RequestMetrics
from steptally.service.api.limits import BodyBudget, RequestLimits
from steptally.service.auth.middleware import Guard
from steptally.service.auth.ratelimit import limiter_of
from steptally.service.auth.tokens import open_tokens
from steptally.service.coordination.fanout import RedisFanout
from steptally.service.coordination.keys import RedisKeys
from steptally.service.coordination.pg_wake import FinalisedWake
from steptally.service.dashboard import router as dashboard
from steptally.service.metrics.registry import build_registry
from steptally.service.settings import Settings
from steptally.service.store.factory import open_store
from steptally.service.store.protocol import Store
from steptally.service.usecase.events import EventHub
from steptally.service.usecase.facade import Service, sweep_forever
from steptally.service.workers import worker_peers


def create_app(
    settings: Settings,
    *,
    store: Store | None = None,
    clock: Callable[[], float] = time.time,
    sweep: bool = True,
) -> App:
    """Build the service over ``store`` (None: the one ``settings`` describe); the app
    closes it at shutdown. ``clock`` and ``sweep=False`` exist for tests."""
    # a worker of `serve --workers N` without Redis hears the others through the parent;
    # other processes of one PostgreSQL database without Redis, through the database
    peers = worker_peers() if settings.events_poll else None
    postgres = make_url(settings.database_url).get_backend_name() == "postgresql"
    by_database = settings.events_poll and peers is None and postgres
    if store is None:
        store = open_store(settings, notify=by_database, opened_at=clock())
    window_s = settings.metrics_window_s  # /metrics: the runs active within it
    registry, telemetry = build_registry(store.exposition_snapshot, window_s, clock)
    hub = EventHub()
    hub.degraded = settings.events_poll
    fanout = None
    if settings.redis_url is not None:
        fanout = RedisFanout(settings.redis_url, RedisKeys(settings.redis_prefix), hub)
    wake = FinalisedWake(settings.database_url, hub) if by_database else None
    if peers is not None:
        peers.on_heard(hub.wake)
    timeout_s = settings.default_step_timeout_s
    service = Service(
        store,
        telemetry,
        timeout_s,
        clock,
        events=hub,
        publisher=fanout,
        announce=peers.announce if peers is not None else None,
    )
    tokens = open_tokens(settings)  # None: auth is off
    handoff = Handoff()
    limiter = limiter_of(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = None
        try:
            await run_in_threadpool(store.check_ready)
            if fanout is not None:
                await fanout.start()
            if wake is not None:
                wake.start()
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
            if wake is not None:
                await run_in_threadpool(wake.stop)
            service.events.close()
            handoff.close()
            store.close()
            if tokens is not None:
                tokens.close()

    app = App(
        title="Steptally",
        version="1",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        redirect_slashes=False,  # a redirect would echo the Host header: a trailing / is 404
    )
    app.state.settings = settings
    app.state.registry = registry
    app.state.telemetry = telemetry
    app.state.store = store
    app.state.service = service
    app.state.handoff = handoff
    app.state.body_budget = BodyBudget(settings.max_inflight_body_bytes, settings.body_wait_s)
    errors.install(app)
    layers = [  # innermost first; the ingest lane goes through the same ones (front.py)
        Middleware(RequestLimits, settings=settings),  # content type and body size
        Middleware(Guard, tokens=tokens, limiter=limiter),  # one limiter
        Middleware(RequestDeadline, seconds=settings.request_timeout_s),
        Middleware(RequestMetrics, telemetry=telemetry),
    ]
    for layer in layers:
        app.add_middleware(layer.cls, *layer.args, **layer.kwargs)
    describe_limits(app, settings.max_world_size, settings.max_step_timeout_s)
    if tokens is not None:
        declare_bearer(app)
    for module in (runs, fragments, steps, events, health, docs):
        app.include_router(module.router)
    lane = fragments.lane(fragments.router.routes)
    app.serve_lane(lane, layers)  # the common ingest
    if tokens is None:  # with auth on, a request's token is read from the database
        app.direct = DirectLane(
            app,
            lane,
            service,
            app.state.body_budget,
            telemetry,
            limiter,
            settings.max_body_bytes,
            settings.request_timeout_s,
        )
    dashboard.install(app)
    return app
