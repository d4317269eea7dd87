"""PostgreSQL's groups of plain pairs, written by the event loop itself.

A writer thread costs every group a hand-over: the event loop queues the batches, the
writer wakes up and takes the interpreter's lock from the loop, makes and sends the
group, waits for the database, and hands the answers back to the loop, which wakes up
in turn. On one core those wake-ups and switches are ~5 % of a body's cost, and the
loop cannot read a request while the writer holds the lock. Here the event loop makes
each group of plain pairs (what a reporter sends) itself and sends it as one implicit
transaction (:func:`.pg_pipeline.send`: ``fresh_plain``, which takes the pairs' locks)
on a connection of its own, without waiting: the answer is read when the connection's
socket becomes readable (``loop.add_reader``), and only then, the commit durable, are
the group's batches answered. Measured at 256 ranks on one core, one process: 5,300–
5,800 → 5,950–6,200 rank-steps/s (bench/README.md, Scale).

Groups form as a writer thread forms them (:mod:`.group_commit`): a group waits while
fewer batches are queued than were in flight at once lately and each keeps arriving
within ``linger_s`` of the one before; one group is in the database at a time, and the
batches that arrive meanwhile make the next. (Two groups at a time, each half of
those in flight, so that one is made while the other is stored, was slower: a group's
fixed cost in the database, its commit's sync above all, then came twice as often,
and the database took ~0.7 ms to answer a group of 4 against ~0.4 ms for a group of 8.)

What the loop does not do itself goes to the store's writer threads, as before: a
batch that is not plain, a group of several runs or one the rules would refuse, a
group that ``fresh_plain`` finds not new (a retry, a duplicate, a late rank: it wrote
nothing), and every batch while the loop's connection is being opened (in a thread:
the loop never waits for the database). A finalisation runs in the loop's executor,
the group that completed its steps answered once it is done; but a step that a group
completes, every other pair of which this loop stored itself (or none: every rank of
it in the group), is finalised before the group is sent, from those pairs' partial
states (kept while the step is open: :class:`.sql_ingest.OpenStep`), and written in
the group's transaction (:func:`.sql_ingest.finalise_fresh`), which fails, and the
group goes to the writer threads, unless the step's row and the run are as that
finalisation took them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import pq

from steptally.service.domain.batch import PreparedBatch
from steptally.service.domain.run import RunRecord
from steptally.service.domain.step import StepState
from steptally.service.store import pg_pipeline, sql_ingest
from steptally.service.store.group_commit import Burst, Pending
from steptally.service.store.protocol import Answer, FinalisedStep
from steptally.service.store.sql_postgres import NOT_FRESH, PostgresDialect, changed_steps

if TYPE_CHECKING:
    from steptally.service.store.sql import SqlStore

log = logging.getLogger(__name__)

#: how long after its connection failed to open the loop tries again
RETRY_S = 1.0
#: the most pairs of open steps a loop keeps (:class:`.sql_ingest.OpenStep`), its
#: oldest steps forgotten first (a step forgotten is finalised after its commit): a
#: pair's state of 32 metrics over 8 microbatches is ~1.4 KB, so ~23 MB, 4 steps of
#: 4096 ranks
OPEN_PAIRS = 1 << 14


@dataclass(slots=True)
class _Group:
    """A group sent, its answer still to come."""

    items: list[Pending]
    run: RunRecord
    batches: list[tuple[PreparedBatch, float]]
    sent: pg_pipeline.Sent
    fresh: sql_ingest.Fresh
    #: the steps it completed, finalised in its transaction, by step
    finalised: dict[int, FinalisedStep]


class LoopWriter:
    """One event loop's writer of plain groups (see the module). Every method runs on
    ``loop``."""

    def __init__(
        self,
        store: SqlStore,
        loop: asyncio.AbstractEventLoop,
        max_batches: int,
        linger_s: float,
        hand_over: Callable[[Pending], None],
    ) -> None:
        """``hand_over``: store a batch through the writer threads, answered from there."""
        self._store = store
        self._loop = loop
        self._max_batches = max_batches
        self._hand_over_one = hand_over
        self._driver: psycopg.Connection[Any] | None = None
        self._socket = -1  # the connection's, while it is open
        self._connecting = False
        self._retry_at = 0.0
        self._closed = False
        self._queue: deque[Pending] = deque()
        self._sent: _Group | None = None
        self._results: list[pq.abc.PGresult] = []
        self._burst = Burst(linger_s)
        self._timer: asyncio.TimerHandle | None = None
        #: the open steps of which this loop stored every pair, by (run, step), oldest first
        self._open_steps: dict[tuple[int, int], sql_ingest.OpenStep] = {}
        self._open_pairs = 0

    def submit(self, run: RunRecord, batch: PreparedBatch, now: float, answer: Answer) -> None:
        """Store a batch of plain pairs; ``answer`` is called (on the loop) with its
        outcome or error."""
        item = Pending(run, batch, now, 0, future=None, answer=(self._loop, answer))
        if self._driver is None:  # not connected (yet, or any more)
            self._connect()
            self._hand_over_one(item)
            return
        self._queue.append(item)
        self._burst.arrived()
        self._send_ready()

    def close(self) -> None:
        """Fail the group sent (nothing of it is known durable), hand what is queued to
        the writer threads, which store it before they stop, and let the connection go."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._lost(RuntimeError("the store is closed"))

    # -- the connection -------------------------------------------------------------

    def _connect(self) -> None:
        """Open the loop's connection in a thread (the loop goes on meanwhile), at most
        once every :data:`RETRY_S` after a failure."""
        if self._connecting or self._closed or time.monotonic() < self._retry_at:
            return
        self._connecting = True
        opening = self._loop.run_in_executor(None, self._open)
        opening.add_done_callback(self._opened)

    def _open(self) -> psycopg.Connection[Any]:
        raw = self._store.engine.raw_connection()
        driver = raw.driver_connection
        assert isinstance(driver, psycopg.Connection)
        raw.detach()  # the loop's own, for as long as it works
        dialect = self._store.dialect
        assert isinstance(dialect, PostgresDialect)
        dialect.writer_settings(driver)
        return driver

    def _opened(self, opening: asyncio.Future[psycopg.Connection[Any]]) -> None:
        self._connecting = False
        try:
            driver = opening.result()
        except Exception as exc:  # the writer threads meet the database meanwhile
            log.warning("the event loop's database connection failed to open: %s", exc)
            self._retry_at = time.monotonic() + RETRY_S
            return
        if self._closed:
            driver.close()
            return
        driver.pgconn.nonblocking = 1
        self._socket = driver.pgconn.socket  # asked once lost, libpq raises
        self._loop.add_reader(self._socket, self._readable)
        self._driver = driver

    def _lost(self, exc: BaseException) -> None:
        """The connection failed (or the store closed): the group sent on it fails,
        nothing of it known durable (its answer never came); the batches that come
        next go to the writer threads until another connection is open."""
        driver, self._driver = self._driver, None
        self._results = []
        if driver is not None:
            self._loop.remove_reader(self._socket)
            try:
                driver.close()
            except Exception:  # it is gone either way
                log.debug("closing a lost connection", exc_info=True)
        if self._sent is not None:
            group, self._sent = self._sent, None
            self._answer(group.items, exc)
        queued, self._queue = list(self._queue), deque()
        self._hand_over(queued)

    # -- making and sending groups ---------------------------------------------------

    def _send_ready(self) -> None:
        """Send the next group if none is in the database and one is ready: it holds
        ``max_batches``, or every batch in flight has arrived, or none has for
        ``linger_s`` (then a timer looks again)."""
        while self._queue and self._sent is None and self._driver is not None:
            wait_s = self._burst.wait_s(len(self._queue), self._max_batches)
            if wait_s > 0:
                if self._timer is None:
                    self._timer = self._loop.call_later(wait_s, self._lingered)
                return
            size = min(self._max_batches, len(self._queue))
            self._send([self._queue.popleft() for _ in range(size)])

    def _lingered(self) -> None:
        self._timer = None
        self._send_ready()

    def _send(self, items: list[Pending]) -> None:
        run = items[0].run
        batches = [(p.batch, p.now) for p in items]
        assert self._driver is not None
        try:
            fresh, statements, finalised = self._statements(run, items, batches)
        except Exception as exc:  # a fault of ours: the batches are told, none is lost
            log.exception("making a group of %d batches", len(items))
            self._answer(items, exc)
            return
        if fresh is None or statements is None:  # the general way says what it is
            self._hand_over(items)
            return
        try:
            sent = pg_pipeline.send(self._driver, statements)
        except psycopg.Error as exc:  # nothing of it is durable
            self._answer(items, exc)
            self._lost(exc)
            return
        self._sent = _Group(items, run, batches, sent, fresh, {f.step: f for _, f in finalised})

    def _statements(
        self, run: RunRecord, items: list[Pending], batches: list[tuple[PreparedBatch, float]]
    ) -> tuple[
        sql_ingest.Fresh | None,
        list[tuple[str, dict[str, Any]]] | None,
        list[tuple[StepState, FinalisedStep]],
    ]:
        """A group's fresh write and transaction (None: the general way stores it), and
        the steps it completes, finalised in it (:func:`.sql_ingest.finalise_fresh`:
        every rank of a step in the group, or the rest of them stored by this loop
        before), where the run's spec is known (read by a finalisation of one of its
        steps before). The finalisation after the commit takes a transaction, its
        sync and two round trips more a step, and reads every partial row of it."""
        if not all(p.run.id == run.id for p in items):
            return None, None, []
        fresh = sql_ingest.fresh_write(run, batches)
        if fresh is None:
            return None, None, []
        known = self._store._runs.known(run.id)
        finalised = []
        # the run as the store last read it, which the batches were made for too (their
        # states' columns are the run's; a metric added since, either way: after the
        # commit, with the run read anew)
        if known is not None and known[1] == run:
            mine = {
                s: o for s in fresh.steps if (o := self._open_steps.get((run.id, s))) is not None
            }
            try:
                finalised = sql_ingest.finalise_fresh(run, fresh, max(p.now for p in items), mine)
            except Exception:  # a fault of ours: the general way finalises them after the commit
                log.exception("finalising the steps of a group of %d batches", len(items))
        dialect = self._store.dialect
        assert isinstance(dialect, PostgresDialect)
        statements = dialect.plain_statements(
            run, fresh.batch, fresh.added, fresh.partials, fresh.now,
            [row for row, _ in finalised], known[0] if known is not None else None,
        )  # fmt: skip
        return fresh, statements, finalised

    # -- reading answers -------------------------------------------------------------

    def _readable(self) -> None:
        driver = self._driver
        if driver is None:
            return
        pgconn = driver.pgconn
        try:
            pgconn.consume_input()
            while self._sent is not None and not pgconn.is_busy():
                result = pgconn.get_result()
                if result is None:  # the end of one statement's results
                    if pgconn.status != pq.ConnStatus.OK:
                        raise psycopg.OperationalError(pgconn.get_error_message())
                    continue
                if result.status != pq.ExecStatus.PIPELINE_SYNC:
                    self._results.append(result)
                    continue
                group, self._sent = self._sent, None
                results, self._results = self._results, []
                pg_pipeline.leave(driver)
                try:
                    self._answered(group, results)
                except Exception as exc:  # a fault of ours: the batches are told
                    log.exception("answering a group of %d batches", len(group.items))
                    self._answer(group.items, exc)
            if pgconn.status != pq.ConnStatus.OK:
                raise psycopg.OperationalError(pgconn.get_error_message())
        except psycopg.OperationalError as exc:
            self._lost(exc)
            return
        self._send_ready()

    def _answered(self, group: _Group, results: list[pq.abc.PGresult]) -> None:
        """A group's transaction answered: its batches' outcomes (after the
        finalisation of the steps it completed, in the executor), or to the writer
        threads where it was not new, or its error."""
        try:
            found = pg_pipeline.rows_of(group.sent, results)[0]
        except psycopg.Error as exc:
            if exc.sqlstate in NOT_FRESH:  # nothing written
                self._forget(group.run.id, group.fresh.steps)  # the writer threads add to them
                self._hand_over(group.items)
            else:
                self._answer(group.items, exc)
            return
        changed = changed_steps(found)
        self._remember(group, changed)
        stored = sql_ingest.fresh_outcomes(group.batches, changed)
        sql_ingest.finalised_with(stored, group.finalised)
        for p, one in zip(group.items, stored, strict=True):
            p.outcome = one.outcome
        if not any(sql_ingest.due(group.run.world_size, one.changed) for one in stored):
            self._answer(group.items)
            return
        nows = [p.now for p in group.items]

        def finalise() -> None:
            self._store._finalise_after(group.run, stored, nows)

        def finalised(task: asyncio.Future[None]) -> None:
            if not task.cancelled() and task.exception() is not None:
                log.error("finalising after a group", exc_info=task.exception())
            self._answer(group.items)  # durable, finalised or (logged) not

        self._loop.run_in_executor(None, finalise).add_done_callback(finalised)

    def _remember(self, group: _Group, changed: list[StepState]) -> None:
        """Keep the open steps of which this loop has now stored every pair
        (:meth:`.sql_ingest.OpenStep.of`), ``changed`` their rows as the group's
        committed write left them; forget the others of the group's steps."""
        run_id = group.run.id
        for row in changed:
            key = (run_id, row.step)
            before = self._forget_one(key)
            if row.step in group.finalised or sql_ingest.due(group.run.world_size, [row]):
                continue
            known = sql_ingest.OpenStep.of(row, group.fresh, before)
            if known is not None:
                self._open_steps[key] = known
                self._open_pairs += len(known.parts)
        while self._open_pairs > OPEN_PAIRS:
            self._forget_one(next(iter(self._open_steps)))

    def _forget(self, run_id: int, steps: Iterable[int]) -> None:
        for step in steps:
            self._forget_one((run_id, step))

    def _forget_one(self, key: tuple[int, int]) -> sql_ingest.OpenStep | None:
        known = self._open_steps.pop(key, None)
        if known is not None:
            self._open_pairs -= len(known.parts)
        return known

    def _answer(self, items: list[Pending], error: BaseException | None = None) -> None:
        self._burst.in_flight -= len(items)
        for p in items:
            assert p.answer is not None
            try:
                p.answer[1](None if error is not None else p.outcome, error)
            except Exception:
                log.exception("answering a stored batch")

    def _hand_over(self, items: list[Pending]) -> None:
        self._burst.in_flight -= len(items)
        for p in items:
            self._hand_over_one(p)
