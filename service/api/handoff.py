"""The hand-off of a request's blocking work to a worker thread, and its result back.

``await handoff.run(fn)`` runs ``fn()`` on one of the app's own worker threads (a
``ThreadPoolExecutor`` of ``threads``, as many as anyio's default thread limit) and
returns its result on the event loop: one queue put, and one wake-up of the loop when
it is done. Starlette's ``run_in_threadpool`` does the same through anyio's capacity
limiter, its worker bookkeeping and a context copy, about twice the CPU per call.

As with ``run_in_threadpool``, a caller that is cancelled (the request deadline) stops
waiting at once while ``fn`` runs on to its end in its thread. The pool starts on the
first call and again after :meth:`close`, so an app can be served more than once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
THREADS = 40  # anyio's default limit of worker threads


class Handoff:
    def __init__(self, threads: int = THREADS, name: str = "steptally-worker") -> None:
        self.threads = threads
        self.name = name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _started(self) -> ThreadPoolExecutor:
        pool = self._pool
        if pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.threads, self.name)
                pool = self._pool
        return pool

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._started(), fn)

    def close(self) -> None:
        """Stop taking work; what runs finishes on its thread."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)


def awaited(future: Future[T]) -> asyncio.Future[T]:
    """An event-loop future that takes ``future``'s result or error when it is done.

    A waiter that is cancelled (the request deadline) cancels only this future, never
    ``future``: the work behind it (a batch with its store's writer) goes on to its end.
    ``asyncio.shield(asyncio.wrap_future(future))`` says the same with two futures more
    and their callbacks.
    """
    loop = asyncio.get_running_loop()
    out: asyncio.Future[T] = loop.create_future()

    def copy(done: Future[T]) -> None:
        if out.cancelled():
            return
        try:  # one look at ``done`` (each takes its lock)
            result = done.result(timeout=0)
        except CancelledError:
            out.cancel()
        except BaseException as error:
            out.set_exception(error)
        else:
            out.set_result(result)

    def done_elsewhere(done: Future[T]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
            loop.call_soon_threadsafe(copy, done)

    if future.done():
        copy(future)
    else:
        future.add_done_callback(done_elsewhere)
    return out
