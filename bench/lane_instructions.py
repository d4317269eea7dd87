"""The instructions a reporter's request costs the serving process, HTTP included,
counted by callgrind: ``ingest_instructions.py`` with the request's way in and out.

In one process, on a fresh SQLite database: the service's app (``create_app``, the
settings of ``steptally serve``) under the service's HTTP protocol
(:class:`~steptally.service.api.direct.LaneProtocol`) on uvloop, with 8 connections
whose transports are in memory: each round, every connection is handed one whole
request (``bench/scale.py``'s bodies and request bytes, 256 ranks) as the socket would
hand it, and the loop runs until all 8 are answered: the lane, the event loop's group
of 8, its sync, the answers' bytes. The sync runs on the loop, not in its executor: how
often two threads take turns with the interpreter's lock depends on the clock, and
with a thread the same code's count moved by ±8 % from run to run. What the kernel
does with sockets is not in it (there are none); everything the process does for a
request in Python and C is.

Run under ``valgrind --tool=callgrind`` with ``n`` and ``2n`` steps of every rank, the
bodies of ``2n`` made in both; the difference is what ``256 n`` requests cost once
warm. ``--before REV`` counts that revision first. Printed: instructions a request.

Usage:
    python bench/lane_instructions.py
    python bench/lane_instructions.py --before HEAD --steps 2
    python bench/lane_instructions.py --inner --steps 4     # one run, no valgrind
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

from ingest_instructions import callgrind, each_version

HERE = Path(__file__).resolve().parent
RANKS = 256
CONNECTIONS = 8


class Transport(asyncio.Transport):
    """A connection's transport in memory: what the server writes, kept."""

    def __init__(self, wrote: Any) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closing = False
        self.wrote = wrote  # called at each write: the loop waits on it, never spins

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(
            name, default
        )

    def write(self, data: Any) -> None:
        self.written.append(bytes(data))
        self.wrote()

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def inner(steps: int, made: int) -> None:
    """``steps`` steps of every rank through the protocol (of ``made`` made first)."""
    sys.path.insert(0, str(HERE))
    import uvicorn
    import uvloop
    from ingest import spec
    from loadgen import request
    from scale import METRICS, RUN, prepared
    from uvicorn.server import ServerState

    from steptally.service.api.direct import LaneProtocol
    from steptally.service.app import create_app
    from steptally.service.serving import tune_collector
    from steptally.service.settings import Settings
    from steptally.service.store.migration import upgrade

    bodies = prepared(RANKS, made)[:steps]
    path = f"/v1/runs/{RUN}/fragments"
    with tempfile.TemporaryDirectory() as d:
        settings = Settings(database_url=f"sqlite:///{d}/lane.sqlite3")
        upgrade(settings.database_url)
        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)

        def inline(executor: Any, fn: Any, *args: Any) -> asyncio.Future[Any]:
            """What the executor would run, run here: a thread's turns with the
            interpreter's lock depend on the clock, and its instructions with them."""
            done = loop.create_future()
            try:
                done.set_result(fn(*args))
            except Exception as exc:
                done.set_exception(exc)
            return done

        loop.run_in_executor = inline  # type: ignore[method-assign,assignment]

        answered = [0]

        async def main() -> None:
            app = create_app(settings, sweep=False)
            config = uvicorn.Config(app, http=LaneProtocol, log_config=None, lifespan="on")
            config.load()
            state = ServerState()
            async with app.router.lifespan_context(app):
                import httpx

                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://x") as c:
                    made = await c.post(
                        "/v1/runs",
                        json={
                            "name": RUN,
                            "world_size": RANKS,
                            "step_timeout_s": 3600,
                            **spec(METRICS),
                        },
                    )
                    assert made.status_code in (200, 201), made.text
                tune_collector()
                loop = asyncio.get_running_loop()
                waiting: list[Any] = [0, None]  # answers still to come, and their future

                def wrote() -> None:
                    waiting[0] -= 1
                    if waiting[0] == 0:
                        waiting[1].set_result(None)

                conns = []
                for _ in range(CONNECTIONS):
                    protocol = LaneProtocol(config=config, server_state=state, app_state={})
                    t = Transport(wrote)
                    protocol.connection_made(t)
                    conns.append((protocol, t))
                for step in bodies:
                    for at in range(0, RANKS, CONNECTIONS):
                        waiting[:] = [CONNECTIONS, loop.create_future()]
                        for (protocol, _), body in zip(conns, step[at:], strict=False):
                            protocol.data_received(request("POST", 8000, path, body))
                        await waiting[1]
                        for _, t in conns:
                            answer = b"".join(t.written)
                            assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
                            t.written.clear()
                            answered[0] += 1

        loop.run_until_complete(main())
        loop.close()
    assert answered[0] == RANKS * steps, answered


def counted(steps: int, made: int, pythonpath: Path | None = None) -> int:
    """User-space instructions of one run of :func:`inner` under callgrind (with the
    package of ``pythonpath`` first, given)."""
    args = ["--steps", str(steps), "--made", str(made)]
    # the same dicts' probes in every run
    return callgrind(Path(__file__), args, pythonpath, {"PYTHONHASHSEED": "0"})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=2, help="n: the runs take n and 2n steps")
    p.add_argument("--before", help="a revision to count first, built as scale_rounds.py does")
    p.add_argument("--inner", action="store_true", help="one run, in this process")
    p.add_argument("--made", type=int, help="with --inner: steps of bodies made (≥ --steps)")
    args = p.parse_args()
    if args.inner:
        inner(args.steps, args.made or args.steps)
        return
    requests = RANKS * args.steps

    def count(name: str, path: Path | None) -> None:
        one = counted(args.steps, 2 * args.steps, path)
        two = counted(2 * args.steps, 2 * args.steps, path)
        print(f"{name}: {(two - one) / requests:,.0f} instructions a request "
              f"({requests} requests, {CONNECTIONS} at a time, SQLite, no sockets)",
              flush=True)  # fmt: skip

    each_version(args.before, count)


if __name__ == "__main__":
    main()
