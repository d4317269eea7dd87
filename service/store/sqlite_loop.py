"""SQLite's groups of plain pairs, written by the event loop itself.

A writer thread costs every group a hand-over: the event loop queues the batches, the
writer wakes up and takes the interpreter's lock from the loop, stores the group and
hands the answers back to the loop, which wakes up in turn. SQLite's statements run in
this process, on the interpreter's lock for their Python and on the same core for the
rest, so a writer thread buys no parallel work on one core, only the switches. Here the
event loop stores each group of plain pairs (what a reporter sends) itself, in the
store's usual transaction (its plain write, :meth:`.SqliteDialect.store_fresh`, the
steps it completes finalised inside), on a connection of its own; then the WAL's
``fdatasync`` runs in the loop's executor, and only once it returns are the group's
batches answered. The next group may be stored while that sync waits on the disk: one
sync makes every commit before it durable.

Groups form as a writer thread forms them (:mod:`.group_commit`): a group waits while
fewer batches are queued than were in flight at once lately and each keeps arriving
within ``linger_s`` of the one before.

The loop never waits for another writer: it takes the store's writer lock only if it is
free (:meth:`.WriterLock.try_enter`; another process's writer, ``serve --workers N``, or
this process's writer threads may hold it), and a group that finds it held goes to the
writer threads, as does every batch that is not plain. A database in memory keeps the
writer threads (each connection would be a database of its own).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from steptally.service.domain.batch import PreparedBatch
from steptally.service.domain.run import RunRecord
from steptally.service.store.dialect import WriterLock
from steptally.service.store.group_commit import Burst, Pending
from steptally.service.store.protocol import Answer

if TYPE_CHECKING:
    from steptally.service.store.sql import SqlStore

log = logging.getLogger(__name__)


class SqliteLoopWriter:
    """One event loop's writer of plain groups on SQLite (see the module). Every method
    runs on ``loop``."""

    def __init__(
        self,
        store: SqlStore,
        loop: asyncio.AbstractEventLoop,
        lock: WriterLock,
        max_batches: int,
        linger_s: float,
        hand_over: Callable[[Pending], None],
    ) -> None:
        """``lock``: the store's writer lock; ``hand_over``: store a batch through the
        writer threads, answered from there."""
        self._store = store
        self._loop = loop
        self._lock = lock
        self._max_batches = max_batches
        self._hand_over_one = hand_over
        self._closed = False
        self._queue: deque[Pending] = deque()
        self._burst = Burst(linger_s)
        self._timer: asyncio.TimerHandle | None = None

    def submit(self, run: RunRecord, batch: PreparedBatch, now: float, answer: Answer) -> None:
        """Store a batch of plain pairs; ``answer`` is called (on the loop) with its
        outcome or error once it is durable (or failed)."""
        item = Pending(run, batch, now, 0, future=None, answer=(self._loop, answer))
        if self._closed:
            self._hand_over_one(item)  # the threads say the store is closed
            return
        self._queue.append(item)
        self._burst.arrived()
        self._write_ready()

    def close(self) -> None:
        """Hand what is queued to the writer threads, which store it before they stop
        (a group whose sync is running is answered when it returns)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        queued, self._queue = list(self._queue), deque()
        self._hand_over(queued)

    def _write_ready(self) -> None:
        """Store the next group if one is ready: it holds ``max_batches``, or every batch
        in flight has arrived, or none has for ``linger_s`` (then a timer looks again)."""
        while self._queue and not self._closed:
            wait_s = self._burst.wait_s(len(self._queue), self._max_batches)
            if wait_s > 0:
                if self._timer is None:
                    self._timer = self._loop.call_later(wait_s, self._lingered)
                return
            size = min(self._max_batches, len(self._queue))
            self._write([self._queue.popleft() for _ in range(size)])

    def _lingered(self) -> None:
        self._timer = None
        self._write_ready()

    def _write(self, items: list[Pending]) -> None:
        """Store ``items`` in one transaction, here, if the writer lock is free (else
        the writer threads do), then sync in the executor and answer after."""
        if not self._lock.try_enter():
            self._hand_over(items)
            return
        store = self._store
        try:
            store.store_held(items)
        except BaseException as exc:  # the transaction failed: nothing of it is durable
            for p in items:
                p.outcome, p.error = None, exc
        finally:
            self._lock.__exit__(None, None, None)
        syncing = self._loop.run_in_executor(None, store.dialect.sync)
        syncing.add_done_callback(lambda done: self._synced(items, done))

    def _synced(self, items: list[Pending], done: asyncio.Future[None]) -> None:
        error = RuntimeError("the sync was cancelled") if done.cancelled() else done.exception()
        if error is not None:  # committed, but not known durable: every batch fails
            log.error("syncing the WAL after a group", exc_info=error)
            for p in items:
                p.outcome, p.error = None, error
        self._burst.in_flight -= len(items)
        for p in items:
            if p.error is None and p.outcome is None:
                p.error = RuntimeError("the group's transaction did not finish")
            assert p.answer is not None
            try:
                p.answer[1](p.outcome, p.error)
            except Exception:
                log.exception("answering a stored batch")

    def _hand_over(self, items: list[Pending]) -> None:
        self._burst.in_flight -= len(items)
        for p in items:
            self._hand_over_one(p)
