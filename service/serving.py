"""Running the service under uvicorn: one process, or N workers that must all start.

With ``--workers N`` each worker process builds its own app from the settings, which
the parent hands over as ``STEPTALLY_*`` environment variables. A worker that cannot
build its app (:func:`worker_app`) or start it exits with uvicorn's start-failure
status; uvicorn's supervisor then stops instead of restarting workers that would fail
the same way forever, and :func:`serve` returns that status, so ``steptally serve
--workers N`` exits non-zero.

Each worker listens on a socket of its own, all bound to the one address with
``SO_REUSEPORT`` (:func:`listeners`), and the kernel spreads new connections over them
by a hash of their addresses. With one listening socket shared by all (uvicorn's way),
the worker that woke first accepted whatever was queued: 32 connections opened at once
went 31 to one worker and 1 to the other, and since a reporter keeps its connection for
the whole run, one process served nearly all of the load while the other idled
(``tests/integration/test_service_workers.py``; bench/README.md, Scale). The parent
keeps every socket open, so a worker that dies and is started again takes over its
socket and the connections queued on it.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import sys

import uvicorn
from fastapi import FastAPI
from pydantic import ValidationError
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import Multiprocess
from uvicorn.supervisors.multiprocess import Process

from steptally.service.api.direct import LaneProtocol
from steptally.service.settings import Settings

APP_FACTORY = "steptally.service.serving:worker_app"
LOG = logging.getLogger("uvicorn.error")  # where uvicorn's supervisor says the same


def serve(settings: Settings, workers: int) -> int:
    """Serve until stopped; the exit status (non-zero: the service never started)."""
    if workers == 1:
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
        sockets = listeners(settings.host, settings.port, workers)
    except OSError as exc:
        where = f"{settings.host}:{settings.port}"
        print(f"steptally: cannot listen on {where}: {exc.strerror}", file=sys.stderr, flush=True)
        return STARTUP_FAILURE
    supervisor = Spread(config, sockets)
    supervisor.run()
    failed = [p for p in supervisor.processes if p.exitcode == STARTUP_FAILURE]
    return STARTUP_FAILURE if failed else 0


def listeners(host: str, port: int, n: int) -> list[socket.socket]:
    """``n`` sockets bound to ``host:port`` with ``SO_REUSEPORT``, one per worker (not
    listening yet: each worker's server listens on its own). With port 0 the first
    takes a free port and the others join it. Raises ``OSError`` when the address is
    taken (by another program, or by one that shares ports with nobody)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bound: list[socket.socket] = []
    try:
        for _ in range(n):
            sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]
            sock.set_inheritable(True)
    except OSError:
        for sock in bound:
            sock.close()
        raise
    return bound


class Spread(Multiprocess):
    """uvicorn's supervisor, with each worker on its own listening socket (the module's
    docstring): worker ``i`` is started, and started again, on socket ``i``."""

    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket]) -> None:
        super().__init__(config, sockets)
        self.own = sockets

    def init_processes(self) -> None:
        for sock in self.own:
            process = Process(self.config, [sock])
            process.start()
            self.processes.append(process)

    def keep_subprocess_alive(self) -> None:
        """As uvicorn's: a worker that does not answer is killed, and started again, but
        on its own socket; one that failed to start stops the whole service."""
        if self.should_exit.is_set():
            return
        for i, process in enumerate(self.processes):
            if process.is_alive(timeout=self.config.timeout_worker_healthcheck):
                continue
            process.kill()
            process.join()
            if process.exitcode == STARTUP_FAILURE:
                LOG.error("worker %s failed to start; stopping", process.pid)
                self.should_exit.set()
            if self.should_exit.is_set():
                return
            LOG.info("worker %s died; starting another on its socket", process.pid)
            process = Process(self.config, [self.own[i]])
            process.start()
            self.processes[i] = process


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
        print(f"steptally: a worker cannot start: {reason}", file=sys.stderr, flush=True)
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
