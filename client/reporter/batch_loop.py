"""The batcher thread's one turn: drain the intake, cut batches, hand them to the outbox.

It waits for device values (and reads held host tensors) off the training thread,
refuses a fragment whose value turned out invalid, cuts a batch when one is due (by
count, bytes or time, or because ``flush()`` asked), encodes it and puts it in the
outbox. It never touches the network, so the intake keeps draining into memory or
the spool however slow the service is. When memory and spool are both full, the
batch is lost (through ``drop``) but its commits still go out, so that the service
shows the steps as incomplete.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from steptally.client.reporter.batcher import Batcher
from steptally.client.reporter.capture import Entry
from steptally.client.reporter.intake import Intake
from steptally.client.reporter.options import ReporterOptions
from steptally.client.reporter.outbox import Outbox, Placed
from steptally.client.reporter.parcel import encode
from steptally.client.reporter.stats import Counters, Stats
from steptally.client.wire import Commit, FragmentBatch

log = logging.getLogger("steptally.reporter")
YIELD_EVERY = 32  # queue items handled between offers of the GIL to the training thread
# The longest the thread sleeps: how late a batch full by count may be cut. log()
# never wakes it (see :mod:`.intake`), so it looks on this timer.
POLL_S = 0.05


class BatchLoop:
    def __init__(
        self,
        intake: Intake,
        outbox: Outbox,
        options: ReporterOptions,
        counters: Counters,
        stop: threading.Event,
        settle: Callable[[int], None],
        drop: Callable[[int, str], None],
        reject: Callable[[int, str], None],
        stats: Callable[[], Stats],
        log_every_s: float | None = None,
    ) -> None:
        self.intake, self.outbox, self.options = intake, outbox, options
        self.counters, self._stop = counters, stop
        self._settle, self._drop, self._reject, self._stats = settle, drop, reject, stats
        self.batcher = Batcher(intake.rank, options)
        self.log_every_s = log_every_s
        self._next_line = time.monotonic() + (log_every_s or 0)
        self._flush_gen = self._served_gen = 0

    def request_flush(self) -> None:
        """Cut what is held at the next turn, due or not, and wake the thread."""
        self._flush_gen += 1
        self.intake.wake.set()

    def held(self) -> int:
        """Fragments drained from the intake and not yet cut into a batch."""
        return len(self.batcher.entries)

    def once(self) -> bool:
        stopping = self._stop.is_set()
        gen = self._flush_gen
        for i, item in enumerate(self.intake.drain(), 1):
            self._take(item)
            if i % YIELD_EVERY == 0:
                time.sleep(0)  # hand the GIL to the training thread if it waits
        now = time.monotonic()
        if self.batcher.due(now) or gen != self._served_gen or stopping:
            self._ship()
            self._served_gen = gen
        if stopping:
            return False
        if self.log_every_s and now >= self._next_line:
            log.info("steptally: %s", self._stats().line())
            self._next_line = now + self.log_every_s
        poll = min(POLL_S, max(0.01, self.options.flush_interval_s / 2))
        deadline = self.batcher.deadline()
        self.intake.wake.wait(poll if deadline is None else min(poll, max(0.0, deadline - now)))
        self.intake.wake.clear()
        return True

    def _take(self, item: Entry | Commit) -> None:
        now = time.monotonic()
        if isinstance(item, Entry) and item.unread():
            reason = item.resolve()
            if reason is not None:
                self._reject(1, f"rank {self.intake.rank} step {item.step}: {reason}")
                self.batcher.settle_dropped(now)
                return
        self.batcher.add(item, now)
        if self.batcher.due(now):
            self._ship()

    def _ship(self) -> None:
        cut = self.batcher.cut()
        if cut is None:
            return
        parcel = encode(cut.batch, self.options.gzip_min_bytes, cut.items)
        time.sleep(0)  # encoding held the GIL for a while: let the training thread in
        placed = self.outbox.put(parcel)
        if placed is Placed.SPOOL:
            self.counters.add(spooled=parcel.fragments)
        elif placed is Placed.DROPPED:
            message = (
                f"memory and spool are full: dropped {parcel.fragments} fragments; their "
                "steps will show as incomplete; raise max_spool_bytes or max_queue_bytes"
            )
            log.error("steptally: %s", message)
            self._drop(parcel.fragments, message)
            if cut.batch.commits:  # a few bytes, and they make the loss visible
                commits = FragmentBatch(commits=cut.batch.commits)
                self.outbox.put(encode(commits, self.options.gzip_min_bytes, 0), force=True)
            self._settle(parcel.items)
