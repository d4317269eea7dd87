"""The workers' word to each other through the parent (``service/workers.py``), and
the degraded event stream that reads the database once for every wake queued."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest

from steptally.service.usecase.events import EventCursor, EventHub, StepEvent, step_events
from steptally.service.workers import CLOSED, FINALISED, Dealer, Peers

T = TypeVar("T")


def _nothing_waiting(sock: socket.socket) -> bool:
    try:
        sock.recv(16, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True
    return False


def test_a_workers_finalisations_reach_every_other_worker_and_not_itself() -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        dealer = Dealer(listening, 3)
        dealer.start()
        try:
            first, second, third = dealer.theirs
            for note in (CLOSED, FINALISED, FINALISED, CLOSED):
                first.send(note)
            for other in (second, third):
                other.settimeout(5)
                assert other.recv(16) == FINALISED
            time.sleep(0.2)  # whatever else the dealer would send has been sent
            assert _nothing_waiting(first)  # the one that finalised is not told
            third.send(FINALISED)
            first.settimeout(5)
            assert first.recv(16) == FINALISED
            assert second.recv(16) == FINALISED
        finally:
            dealer.close()
        assert dealer.held == [-2, 0, 0]  # the closes still counted beside the words


def test_a_worker_announces_without_blocking_and_hears_the_others() -> None:
    ours, parent = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, parent:
        peers = Peers(ours)
        heard: list[int] = []
        peers.on_heard(lambda: heard.append(1))
        peers.on_heard(lambda: heard.append(2))
        peers.announce()
        assert parent.recv(16) == FINALISED
        peers.heard()
        assert heard == [1, 2]
        sent = 0
        with pytest.raises(BlockingIOError):  # the parent reads nothing: the pair fills
            while True:
                ours.send(FINALISED, socket.MSG_DONTWAIT)
                sent += 1
        assert sent > 0
        peers.announce()  # full: neither blocks nor raises


class _Database:
    """An event source whose replays count the database's reads."""

    def __init__(self, hub: EventHub) -> None:
        self.events = hub
        self.clock = time.time
        self.steps: list[StepEvent] = []
        self.reads = 0

    def replay(self, run: Any, after: EventCursor, limit: int) -> list[StepEvent]:
        self.reads += 1
        return [e for e in self.steps if e.cursor > after][:limit]


def _run(scenario: Coroutine[Any, Any, T]) -> T:
    """``scenario`` on an event loop of its own, in a thread of its own (this thread may
    have one running: the browser tests' Playwright leaves its loop set)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, scenario).result()


def _event(step: int) -> StepEvent:
    return StepEvent(EventCursor(time.time(), step, 1), {"step": step})


def test_a_degraded_stream_reads_once_for_every_wake_queued() -> None:
    async def scenario() -> tuple[list[int], int]:
        hub = EventHub()
        hub.degraded = True
        database = _Database(hub)
        sub = hub.subscribe("r")
        stream = step_events(database, "r", None, sub, start=EventCursor(0.0, 0, 0))  # type: ignore[arg-type]
        database.steps = [_event(s) for s in range(3)]
        for _ in range(5):  # five other workers' finalisations, before the stream looks
            hub.wake()
        await asyncio.sleep(0)  # the wakes are queued on this loop
        got = [(await anext(stream)).cursor.step for _ in range(3)]
        with pytest.raises(TimeoutError):  # nothing more: it waits for the next wake
            await asyncio.wait_for(anext(stream), 0.2)
        return got, database.reads

    got, reads = _run(scenario())
    assert got == [0, 1, 2]
    assert reads == 1


def test_a_degraded_stream_ends_when_its_end_is_queued_behind_a_wake() -> None:
    async def scenario() -> int:
        hub = EventHub()
        hub.degraded = True
        database = _Database(hub)
        sub = hub.subscribe("r")
        stream = step_events(database, "r", None, sub, start=EventCursor(0.0, 0, 0))  # type: ignore[arg-type]
        hub.wake()
        hub.close()
        await asyncio.sleep(0)
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        return database.reads

    assert _run(scenario()) == 0
