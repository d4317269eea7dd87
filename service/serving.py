"""Running the service under uvicorn: one process, or N workers that must all start.

With ``--workers N`` each worker process builds its own app from the settings, which
the parent hands over as ``STEPTALLY_*`` environment variables. A worker that cannot
build its app (:func:`worker_app`) or start it exits with uvicorn's start-failure
status; uvicorn's supervisor then stops instead of restarting workers that would fail
the same way forever, and :func:`serve` returns that status, so ``steptally serve
--workers N`` exits non-zero.

The parent accepts the connections and deals each one out to the worker holding the
fewest (``service/workers.py``), so that a job's reporters, which keep their
connections for the whole run, load every worker alike.

With ``cpus`` set (``--cpus``), the service runs on those cores only: one process on
all of them, or worker i alone on the i-th (round robin), with every thread it starts.
A serving process is bound by its interpreter lock to about one core's work, and its
event loop and writer threads hand that lock to each other several times a request:
kept on one core, each hand-over wakes a thread there instead of on another core, which
on the 2-core development machine cost the event loop ~25 % more CPU a request
(bench/README.md, Scale).
"""

from __future__ import annotations

import gc
import os
import sys

import uvicorn
from fastapi import FastAPI
from pydantic import ValidationError
from uvicorn.config import STARTUP_FAILURE

from steptally.service.api.direct import LaneProtocol
from steptally.service.settings import Settings, cpu_list
from steptally.service.workers import Spread, listener

APP_FACTORY = "steptally.service.serving:worker_app"


def unusable_cpus(settings: Settings) -> tuple[list[int], str]:
    """The cores of ``settings.cpus`` this process may not run on, and a description of
    those it may (``sched_getaffinity``): none where ``cpus`` is unset."""
    if settings.cpus is None:
        return [], ""
    if not hasattr(os, "sched_getaffinity"):
        return list(cpu_list(settings.cpus)), "none: this system does not pin processes to cores"
    allowed = os.sched_getaffinity(0)
    shown = ",".join(str(c) for c in sorted(allowed))
    return [c for c in cpu_list(settings.cpus) if c not in allowed], f"cores {shown}"


def serve(settings: Settings, workers: int) -> int:
    """Serve until stopped; the exit status (non-zero: the service never started)."""
    cpus = cpu_list(settings.cpus) if settings.cpus is not None else None
    if workers == 1:
        if cpus is not None:  # before any thread starts: each inherits it
            os.sched_setaffinity(0, cpus)
        from steptally.service.app import create_app

        app = create_app(settings)
        tune_collector()
        # uvicorn exits with STARTUP_FAILURE itself when the app does not start
        uvicorn.run(
            app, host=settings.host, port=settings.port, log_level="warning", http=LaneProtocol
        )
        return 0
    if settings.redis_url is None:  # N processes, one database: none hears all the others
        settings = settings.model_copy(update={"events_poll": True})
    export(settings)
    config = uvicorn.Config(
        APP_FACTORY,
        factory=True,
        workers=workers,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        http=LaneProtocol,
    )
    try:
        sock = listener(settings.host, settings.port, config.backlog)
    except OSError as exc:
        where = f"{settings.host}:{settings.port}"
        print(f"steptally: cannot listen on {where}: {exc.strerror}", file=sys.stderr, flush=True)
        return STARTUP_FAILURE
    supervisor = Spread(config, sock, cpus)
    supervisor.run()
    failed = [p for p in supervisor.processes if p.exitcode == STARTUP_FAILURE]
    return STARTUP_FAILURE if failed else 0


def worker_app() -> FastAPI:
    """The app of one worker process, from the settings in the environment."""
    from steptally.service.app import create_app

    try:
        app = create_app(Settings())
    except Exception as exc:  # whatever it is, every restart would meet it again
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if isinstance(exc, ValidationError):
            first = exc.errors()[0]
            reason = f"invalid setting {'.'.join(map(str, first['loc']))}: {first['msg']}"
        # one write of the whole line: the other workers meet the same error at the same
        # moment, and print's two writes (text, then newline) would interleave with theirs
        sys.stderr.write(f"steptally: a worker cannot start: {reason}\n")
        sys.stderr.flush()
        sys.exit(STARTUP_FAILURE)
    tune_collector()
    return app


# The cyclic collector's thresholds in a serving process: a body of the largest size the
# limits accept holds ~10^6 live containers while it is decoded, and under CPython's
# default (700, 10, 10) its allocations set off a full collection every few hundred
# milliseconds, each a stop of every thread for 0.2-0.3 s that finds nothing (the
# service's hot paths make no reference cycles). 20,000 young objects between
# collections keeps the longest pause under ~0.15 s there (tests/integration/
# test_service_watchdog.py).
COLLECTOR_THRESHOLDS = (20_000, 10, 10)


def tune_collector() -> None:
    """Once the app is built: what exists now (imports, the app) leaves the collector's
    generations for good (``gc.freeze``), so that no pass walks it again, and young
    objects are collected in larger generations."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*COLLECTOR_THRESHOLDS)


def export(settings: Settings) -> None:
    """Put ``settings`` in the environment, where each worker process reads them
    (an unset setting stays unset: the string "None" would not parse)."""
    exported = {k: v for k, v in settings.model_dump().items() if v is not None}
    os.environ.update({f"STEPTALLY_{k.upper()}": str(v) for k, v in exported.items()})
