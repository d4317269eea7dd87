"""Group commit: ingests that arrive while a transaction is in progress share the next one.

Every batch still has to be durable before its answer, and one ``COMMIT`` (an fsync)
per batch is what the database would otherwise spend its time on. So a store's ingests
queue here, and *writer* threads of the store's own take them: a writer takes what is
queued (up to a bound in batches and bytes), stores it in ONE transaction — each batch
all or nothing (a merged group, or a savepoint per batch: ``run_group``'s business) —
commits once, and only then resolves each batch's future with its own outcome or
error. If the transaction itself fails (the ``COMMIT``), every batch of the group fails.

A submitter does not wait in a thread of its own: :meth:`GroupCommit.submit_future`
hands back a :class:`~concurrent.futures.Future`, which the ASGI lane awaits on its
event loop (:meth:`GroupCommit.submit` waits for it, for callers that block), and
:meth:`GroupCommit.submit_call` has a callback called on the submitter's event loop,
every batch of a group that came from one loop answered in ONE call there (the direct
lane: a future and a wake-up of the loop a batch cost it ~5 µs of CPU a body). SQLite has
one writer (the database is its lock); PostgreSQL can have several, each on its own
connection, so that one group's round trips overlap another's.

A writer *lingers* (``linger_s``) before it stores a group that more batches are
about to join: while fewer batches are queued and being stored than were in flight at
once lately (the peak of the last :data:`PEAK_WINDOW_S`), and each new batch keeps
arriving within ``linger_s`` of the one before, it waits for them, at most
:data:`LINGER_ROUNDS` × ``linger_s`` in all. Requests come in bursts — a training step
ends on every rank at once, and each group's answers come back as the next requests
together — and a group that starts on the first of a burst leaves the rest to groups
of their own, each with its transaction, its commit and its sync. A lone batch, or the
last of a burst, never waits longer than ``linger_s``, and one that has nobody to
wait for (a single client) not at all (bench/README.md, Scale). With ``max_wait_s`` a
writer that finds the queue short waits that long for more batches, whether any are
coming or not (off unless set). Writers start with the first batch (not at import or
construction: a process that forks before serving starts its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from steptally.service.domain.batch import PreparedBatch
from steptally.service.domain.run import RunRecord
from steptally.service.store.protocol import Answer, IngestOutcome

log = logging.getLogger(__name__)

#: how long the peak of batches in flight at once is remembered (a writer lingers for
#: as many as that peak while they keep arriving)
PEAK_WINDOW_S = 1.0
#: a writer lingers at most this many times ``linger_s`` for one group
LINGER_ROUNDS = 8


@dataclass(slots=True, eq=False)
class Pending:
    """One queued batch and, once its group has committed, its outcome or error: for its
    ``future``, or (``answer``) for a callback on an event loop."""

    run: RunRecord
    batch: PreparedBatch
    now: float
    size: int
    outcome: IngestOutcome | None = None
    error: BaseException | None = None
    future: Future[IngestOutcome] | None = field(default_factory=Future)
    answer: tuple[asyncio.AbstractEventLoop, Answer] | None = None


@dataclass(slots=True)
class Burst:
    """The batches in flight on an event loop's writer (:mod:`.pg_loop`,
    :mod:`.sqlite_loop`) and the rule a writer thread lingers by (the module's
    docstring): how long the group being made waits for the rest of its burst."""

    linger_s: float
    in_flight: int = 0  # queued, or in a group not yet answered
    peak: int = 0  # the most in flight at once, lately
    peak_at: float = 0.0
    last_arrival: float = 0.0

    def arrived(self) -> None:
        self.in_flight += 1
        now = time.monotonic()
        self.last_arrival = now
        if self.in_flight >= self.peak or now - self.peak_at > PEAK_WINDOW_S:
            self.peak, self.peak_at = self.in_flight, now

    def wait_s(self, queued: int, max_batches: int) -> float:
        """How long a group of the ``queued`` batches waits for more: 0 (it goes now)
        once it holds ``max_batches``, or every batch in flight, or none has arrived
        for ``linger_s``."""
        waited = time.monotonic() - self.last_arrival
        if queued < max_batches and self.in_flight < self.peak and waited < self.linger_s:
            return self.linger_s - waited
        return 0.0


def _settle(p: Pending) -> None:
    """Hand a batch's outcome or error to its future, unless its waiter gave up (then the
    batch is stored all the same, or not, and nobody is told)."""
    if p.future is None:
        return
    with contextlib.suppress(InvalidStateError):  # cancelled by a waiter that gave up
        if p.error is not None:
            p.future.set_exception(p.error)
        else:
            assert p.outcome is not None
            p.future.set_result(p.outcome)


def settle_group(group: list[Pending]) -> None:
    """Hand each batch of a committed (or failed) group its outcome or error: to its
    future, or to its callback, those of one event loop in ONE call on that loop (a
    future and a wake-up of the loop a batch cost ~5 µs of CPU a body, bench/README.md)."""
    answers: dict[asyncio.AbstractEventLoop, list[Pending]] = {}
    for p in group:
        if p.error is None and p.outcome is None:
            p.error = RuntimeError("the group's transaction did not finish")
        if p.answer is None:
            _settle(p)
        else:
            answers.setdefault(p.answer[0], []).append(p)
    for loop, waiting in answers.items():
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
            loop.call_soon_threadsafe(_answer, waiting)


def _answer(waiting: list[Pending]) -> None:
    """On the loop: each batch's callback, in the group's order; one that raises is
    logged and keeps none of the others from theirs."""
    for p in waiting:
        assert p.answer is not None
        try:
            p.answer[1](p.outcome, p.error)
        except Exception:
            log.exception("answering a stored batch")


def batch_bytes(batch: PreparedBatch) -> int:
    """A batch's rough size in the database: its values, presence masks and tails (a
    plain batch's are its pairs' joined values: no masks, no tails; a pair at a time,
    not a fragment at a time, which cost the event loop ~5 % of a body's CPU)."""
    if batch.is_plain():
        return sum(len(v) for _, v in batch.plain.values()) + 16 * len(batch.commits)
    cells = batch.fragments.values()
    return sum(len(v) + len(p or b"") + len(t or b"") for v, p, t in cells) + 16 * len(
        batch.commits
    )


class GroupCommit:
    """The queue and its writer threads; ``run_group`` stores a group in one transaction.

    ``run_group`` sets each item's ``outcome`` or ``error``; if it raises, the whole
    group fails with that exception.
    """

    def __init__(
        self,
        run_group: Callable[[list[Pending]], None],
        max_batches: int,
        max_bytes: int,
        max_wait_s: float = 0.0,
        writers: int = 1,
        name: str = "steptally-writer",
        linger_s: float = 0.0,
    ) -> None:
        """``max_wait_s`` > 0: a writer that finds fewer than ``max_batches`` batches
        queued waits that long at most for more before it starts the transaction;
        ``linger_s`` > 0: it waits for the batches that are still arriving (above)."""
        self._run_group = run_group
        self._max_batches = max_batches
        self._max_bytes = max_bytes
        self._max_wait_s = max_wait_s
        self._linger_s = linger_s
        self._in_flight = 0  # batches queued or in a group being stored
        self._peak = 0  # the most in flight at once, lately
        self._peak_at = 0.0
        self._last_arrival = 0.0
        self._writers = writers
        self._name = name
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._queue: deque[Pending] = deque()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def queued(self) -> int:
        """How many batches wait for a transaction (not counting groups in progress)."""
        with self._lock:
            return len(self._queue)

    def submit(self, run: RunRecord, batch: PreparedBatch, now: float) -> IngestOutcome:
        """Store ``batch`` with the next group; its outcome once that group committed."""
        return self.submit_future(run, batch, now).result()

    def submit_future(
        self, run: RunRecord, batch: PreparedBatch, now: float
    ) -> Future[IngestOutcome]:
        item = Pending(run, batch, now, batch_bytes(batch))
        self._enqueue(item)
        assert item.future is not None
        return item.future

    def submit_call(
        self,
        run: RunRecord,
        batch: PreparedBatch,
        now: float,
        loop: asyncio.AbstractEventLoop,
        answer: Answer,
    ) -> None:
        """Store ``batch`` with the next group; once that group committed (or failed),
        ``answer`` is called on ``loop`` with its outcome or error."""
        self._enqueue(
            Pending(run, batch, now, batch_bytes(batch), future=None, answer=(loop, answer))
        )

    def _enqueue(self, item: Pending) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the store is closed")
            if not self._threads:
                self._start()
            self._queue.append(item)
            self._in_flight += 1
            now = time.monotonic()
            self._last_arrival = now
            if self._in_flight >= self._peak or now - self._peak_at > PEAK_WINDOW_S:
                self._peak, self._peak_at = self._in_flight, now
            if self._wakes_writer():
                self._arrived.notify()

    def _wakes_writer(self) -> bool:
        """Whether the batch just queued can end a writer's wait (the queue's lock held).

        A writer waits for a queue that is not empty, then (lingering) for the burst to
        be queued or the queue to be full; between arrivals its timed wait runs out by
        itself (``linger_s`` after the last one) and looks again. So the batches of a
        burst but the first and the last wake no writer: each wake is a thread switch
        and a turn of the GIL taken from the event loop while it reads the next request
        (bench/README.md, Scale)."""
        queued = len(self._queue)
        return queued == 1 or queued >= self._max_batches or self._in_flight >= self._peak

    def close(self) -> None:
        """Take no more batches; the writers finish what is queued, then stop."""
        with self._lock:
            self._closed = True
            self._arrived.notify_all()
            threads, self._threads = self._threads, []
        for t in threads:
            t.join()

    def _start(self) -> None:
        for i in range(self._writers):
            t = threading.Thread(target=self._write, name=f"{self._name}-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _write(self) -> None:
        while True:
            group = self._next_group()
            if group is None:
                return
            try:
                self._run_group(group)
            except BaseException as exc:  # the transaction failed: nothing of it is durable
                for p in group:
                    p.outcome, p.error = None, exc
            with self._lock:
                self._in_flight -= len(group)
            settle_group(group)

    def _linger(self) -> None:
        """Wait (holding the queue's lock, released while waiting) while more batches
        are arriving than the queue holds: see the module's docstring."""
        end = time.monotonic() + LINGER_ROUNDS * self._linger_s
        while not self._closed and len(self._queue) < self._max_batches:
            if self._in_flight >= self._peak:  # every batch in flight is queued or stored
                return
            left = min(self._last_arrival + self._linger_s, end) - time.monotonic()
            if left <= 0:
                return
            self._arrived.wait(left)

    def _next_group(self) -> list[Pending] | None:
        with self._lock:
            while True:  # another writer may take the queue while this one waits
                while not self._queue:
                    if self._closed:
                        return None
                    self._arrived.wait()
                if self._linger_s > 0:
                    self._linger()
                if self._max_wait_s > 0 and len(self._queue) < self._max_batches:
                    deadline = time.monotonic() + self._max_wait_s
                    while len(self._queue) < self._max_batches:
                        left = deadline - time.monotonic()
                        if left <= 0 or not self._arrived.wait(left):
                            break
                if self._queue:
                    break
            group = [self._queue.popleft()]
            size = group[0].size
            while (
                self._queue
                and len(group) < self._max_batches
                and size + self._queue[0].size <= self._max_bytes
            ):
                size += self._queue[0].size
                group.append(self._queue.popleft())
            return group
