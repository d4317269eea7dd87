"""The hand-off to worker threads: the result comes back, errors too, a cancelled caller
stops waiting while its work runs on, and the pool starts again after it is closed.
``awaited``: a thread's future awaited on the loop, its result, error or cancellation
carried over, and a waiter's cancellation never reaching the work."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import pytest

from steptally.service.api.handoff import THREADS, Handoff, awaited

T = TypeVar("T")


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    """``asyncio.run`` on a thread of its own, away from any loop another test left."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, scenario()).result()


def test_the_work_runs_on_a_worker_thread_and_its_result_comes_back() -> None:
    handoff = Handoff()

    async def scenario() -> tuple[str, str]:
        loop_thread = threading.current_thread().name
        return loop_thread, await handoff.run(lambda: threading.current_thread().name)

    loop_thread, worker = run(scenario)
    handoff.close()
    assert worker != loop_thread
    assert worker.startswith("steptally-worker")
    assert THREADS == 40


def test_an_error_of_the_work_is_raised_to_the_caller() -> None:
    handoff = Handoff()

    def fail() -> None:
        raise LookupError("no such thing")

    async def scenario() -> None:
        await handoff.run(fail)

    with pytest.raises(LookupError, match="no such thing"):
        run(scenario)
    handoff.close()


def test_a_cancelled_caller_stops_waiting_while_the_work_runs_to_its_end() -> None:
    handoff = Handoff()
    finished = threading.Event()

    def slow() -> None:
        time.sleep(0.3)
        finished.set()

    async def scenario() -> float:
        started = time.perf_counter()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(handoff.run(slow), 0.05)
        return time.perf_counter() - started

    waited = run(scenario)
    assert waited < 0.25
    assert not finished.is_set()
    assert finished.wait(2.0)
    handoff.close()


def test_the_pool_starts_again_after_it_is_closed() -> None:
    handoff = Handoff(threads=2)

    async def scenario() -> int:
        return await handoff.run(lambda: 7)

    assert run(scenario) == 7
    handoff.close()
    handoff.close()  # twice is fine
    assert run(scenario) == 7
    handoff.close()


def _settle_later(future: Future[int], delay: float, value: int | BaseException) -> None:
    def settle() -> None:
        time.sleep(delay)
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    threading.Thread(target=settle).start()


def test_awaited_carries_a_result_set_on_another_thread() -> None:
    async def scenario() -> int:
        future: Future[int] = Future()
        _settle_later(future, 0.05, 41)
        return await awaited(future)

    assert run(scenario) == 41


def test_awaited_carries_an_error_and_a_future_already_done() -> None:
    async def scenario() -> int:
        failing: Future[int] = Future()
        _settle_later(failing, 0.02, KeyError("gone"))
        with pytest.raises(KeyError, match="gone"):
            await awaited(failing)
        done: Future[int] = Future()
        done.set_result(5)
        return await awaited(done)

    assert run(scenario) == 5


def test_awaited_a_cancelled_future_cancels_the_waiter() -> None:
    async def scenario() -> None:
        future: Future[int] = Future()
        waiter = awaited(future)
        assert future.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

    run(scenario)


def test_a_cancelled_waiter_leaves_the_future_to_its_thread() -> None:
    async def scenario() -> Future[int]:
        future: Future[int] = Future()
        _settle_later(future, 0.2, 9)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.02):
                await awaited(future)
        assert not future.cancelled()  # the work is not told to stop
        return future

    future = run(scenario)  # its loop has closed by the time the thread settles it
    assert future.result(timeout=2) == 9
