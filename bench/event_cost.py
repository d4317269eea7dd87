"""The CPU a finalisation's event costs the serving process, from the hub to the stream.

In one process and one event loop, without sockets: a step finalised from ``--ranks``
ranks' partial states (``bench/ingest.py``'s 32 metrics and its derived value, made
and finalised by ``finalise_instructions.py``), then ``--n`` events of it published as the
service publishes a committed finalisation (``usecase.facade``: the step object built,
then the hub), each followed by ``--subscribers`` streams: the service's own SSE route
generator (``api.events``) under sse-starlette's response, whose ASGI ``send`` only
counts the bytes. What the HTTP server and the kernel then do with each chunk is not in
it. At 8 ranks a step's event is paid by 8 bodies (bench/README.md, Scale, stop 21).

Printed: CPU (``time.process_time``) an event, the median of 3 rounds, and the part of
it that builds the step object, which every stream shares.

Usage:
    python bench/event_cost.py
    python bench/event_cost.py --subscribers 4 --n 2000
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import anyio
from finalise_instructions import finalise_step, step_parts
from sse_starlette import EventSourceResponse


class Source:
    """What a stream reads of the service (its ``EventSource``)."""

    def __init__(self) -> None:
        from steptally.service.usecase.events import EventHub

        self.events = EventHub()
        self.clock = time.time

    def newest_cursor(self, run: Any) -> Any:
        from steptally.service.usecase.events import EventCursor

        return EventCursor(0.0, 0, 0)

    def replay(self, run: Any, after: Any, limit: int) -> list[Any]:
        return []


async def one_round(ranks: int, n: int, subscribers: int) -> tuple[float, float, int]:
    """CPU µs an event, of which building the step object, and the bytes an event sent."""
    from steptally.service.api.events import _sse
    from steptally.service.domain.progress import StepStatus
    from steptally.service.store.protocol import FinalisedStep, StepRecord
    from steptally.service.usecase import facade

    run, states = step_parts(ranks)
    _, result = finalise_step(run, states)
    source = Source()
    sent: list[list[int]] = [[] for _ in range(subscribers)]
    done = asyncio.Event()
    shutdown = anyio.Event()

    def sender(i: int) -> Any:
        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                sent[i].append(len(message["body"]))
                if all(len(s) > n for s in sent):  # the ": live" comment, then n events
                    done.set()

        return send

    async def receive() -> dict[str, Any]:
        await shutdown.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "GET", "path": "/", "headers": [], "query_string": b""}
    streams = [
        asyncio.create_task(
            EventSourceResponse(_sse(source, run, None, shutdown), ping=15)(
                scope, receive, sender(i)
            )
        )
        for i in range(subscribers)
    ]
    while not all(sent):  # every stream live
        await asyncio.sleep(0.001)
    finalisations = [
        FinalisedStep(
            run.name,
            s,
            StepStatus.COMPLETE,
            1,
            run,
            StepRecord(s, StepStatus.COMPLETE, 1, 0.0, 1.0 + s, result),
        )
        for s in range(1, n + 1)
    ]
    start = time.process_time()
    for f in finalisations[: min(n, 200)]:  # the step object alone
        facade._event(run, f.record)
    built = (time.process_time() - start) / min(n, 200)
    start = time.process_time()
    for f in finalisations:  # as Service._published hands a committed group's steps on
        if source.events.wants(f.run):
            source.events.publish(f.run, [facade._event(run, f.record)])
        await asyncio.sleep(0)
    await asyncio.wait_for(done.wait(), 60)
    took = (time.process_time() - start) / n
    shutdown.set()
    for task in streams:
        task.cancel()
    await asyncio.gather(*streams, return_exceptions=True)
    size = sum(sent[0][1:]) // n
    return took * 1e6, built * 1e6, size


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--n", type=int, default=2000, help="events a round")
    p.add_argument("--subscribers", type=int, default=1, help="streams following the run")
    args = p.parse_args(argv)
    rounds = [asyncio.run(one_round(args.ranks, args.n, args.subscribers)) for _ in range(3)]
    took = statistics.median(r[0] for r in rounds)
    built = statistics.median(r[1] for r in rounds)
    print(
        f"{took:.1f} µs of CPU an event ({args.subscribers} stream(s), {rounds[0][2]:,} bytes "
        f"an event), of which {built:.1f} µs the step object (median of 3 rounds)"
    )


if __name__ == "__main__":
    main()
