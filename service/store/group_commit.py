"""Group commit: ingests that arrive while a transaction is in progress share the next one.

Every batch still has to be durable before its answer, and on one step row the
transactions of concurrent batches run one after another anyway (the step's row lock,
or SQLite's single writer), each paying a ``COMMIT`` (an fsync). So a store's ingests
queue here; the first one that finds no transaction in progress becomes the *leader*:
it takes the queued batches (up to a bound in batches and bytes), runs them in ONE
transaction — each inside its own savepoint, so a batch that raises is rolled back
alone and only its request gets the error — commits once, and only then wakes every
waiter with its own outcome. If the transaction itself fails (the ``COMMIT`` or a
rollback to a savepoint), every batch of the group fails. The leader keeps leading
until its own batch is done; then the next waiter in line takes over.

By default a batch never waits for a timer: a lone batch is a group of one and runs
as before. With ``max_wait_s`` a leader that finds the queue short waits at most that
long for more batches first (a bounded wait, off unless set).

Each waiter sleeps on a condition of its own (over the queue's one lock), so a group's
end wakes only the requests of that group and the next leader, not every waiter: with
a busy queue, waking all of them to find their batch not yet done cost each request a
few thread switches.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from steptally.service.domain.batch import PreparedBatch
from steptally.service.domain.run import RunRecord
from steptally.service.store.protocol import IngestOutcome


@dataclass(slots=True, eq=False)
class Pending:
    """One queued batch and, once its group has committed, its outcome or error."""

    run: RunRecord
    batch: PreparedBatch
    now: float
    size: int
    wake: threading.Condition
    outcome: IngestOutcome | None = None
    error: BaseException | None = None
    done: bool = False


def batch_bytes(batch: PreparedBatch) -> int:
    """A batch's rough size in the database: its values, presence masks and tails."""
    cells = batch.fragments.values()
    return sum(len(v) + len(p or b"") + len(t or b"") for v, p, t in cells) + 16 * len(
        batch.commits
    )


class GroupCommit:
    """The queue and the leader hand-over; ``run_group`` stores a group in one transaction.

    ``run_group`` sets each item's ``outcome`` or ``error``; if it raises, the whole
    group fails with that exception.
    """

    def __init__(
        self,
        run_group: Callable[[list[Pending]], None],
        max_batches: int,
        max_bytes: int,
        max_wait_s: float = 0.0,
    ) -> None:
        """``max_wait_s`` > 0: a leader that finds fewer than ``max_batches`` batches
        queued waits that long at most for more before it starts the transaction."""
        self._run_group = run_group
        self._max_batches = max_batches
        self._max_bytes = max_bytes
        self._max_wait_s = max_wait_s
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # a waiting leader sleeps on it
        self._queue: deque[Pending] = deque()
        self._leading = False

    def queued(self) -> int:
        """How many batches wait for a transaction (not counting a group in progress)."""
        with self._lock:
            return len(self._queue)

    def submit(self, run: RunRecord, batch: PreparedBatch, now: float) -> IngestOutcome:
        item = Pending(run, batch, now, batch_bytes(batch), threading.Condition(self._lock))
        with self._lock:
            self._queue.append(item)
            self._arrived.notify()
            while self._leading and not item.done:
                item.wake.wait()
            lead = not item.done
            if lead:
                self._leading = True
        if lead:
            try:
                while not item.done:
                    self._one_group()
            finally:
                with self._lock:
                    self._leading = False
                    if self._queue:  # the next in line leads
                        self._queue[0].wake.notify()
        if item.error is not None:
            raise item.error
        assert item.outcome is not None
        return item.outcome

    def _one_group(self) -> None:
        with self._lock:
            if self._max_wait_s > 0 and len(self._queue) < self._max_batches:
                deadline = time.monotonic() + self._max_wait_s
                while len(self._queue) < self._max_batches:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._arrived.wait(left):
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
        try:
            self._run_group(group)
        except BaseException as exc:  # the transaction failed: nothing of it is durable
            for p in group:
                p.outcome, p.error = None, exc
        finally:
            with self._lock:
                for p in group:
                    if p.outcome is None and p.error is None:
                        p.error = RuntimeError("the group's transaction did not finish")
                    p.done = True
                    p.wake.notify()
