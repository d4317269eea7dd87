"""The background side: one thread batches, one thread sends.

The *batcher* thread runs :class:`~.batch_loop.BatchLoop` (intake to outbox), the
*sender* thread :class:`~.send_loop.SendLoop` (outbox to the service). Both threads
are daemons, started lazily on the first ``submit`` and started again in a forked
child; ``submit``, ``commit``, ``flush``, ``close`` and the fork are here.

Nothing is lost without being counted: :meth:`Worker.drop` counts it in ``dropped``,
with the reason in ``last_error`` and a warning at most every ``WARN_EVERY_S``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from steptally.client.reporter.batch_loop import BatchLoop
from steptally.client.reporter.capture import Entry, Record
from steptally.client.reporter.intake import Intake
from steptally.client.reporter.options import ReporterOptions
from steptally.client.reporter.outbox import Outbox
from steptally.client.reporter.retry import Backoff
from steptally.client.reporter.send_loop import SendLoop
from steptally.client.reporter.sender import Sender
from steptally.client.reporter.stats import Closed, Counters, Stats

log = logging.getLogger("steptally.reporter")
QUEUE_FULL = (
    "the in-memory queue is full (max_queue_items or max_queue_bytes): a fragment was dropped"
)
DOWN_CLOSE_S = 1.0  # how long close() waits for a service that is not answering
CLOSE_GRACE_S = 0.25  # what close() may take beyond its timeout to spool what is held
WARN_EVERY_S = 10.0  # at most one warning about dropped data this often


class Worker:
    def __init__(
        self,
        intake: Intake,
        outbox: Outbox,
        sender: Sender,
        options: ReporterOptions,
        log_every_s: float | None = None,
        rng: Callable[[], float] | None = None,
    ) -> None:
        self.intake = intake
        self.outbox = outbox
        self.sender = sender
        self.options = options
        self.log_every_s = log_every_s
        self.counters = Counters()
        base, cap = options.backoff_base_s, options.backoff_max_s
        self.backoff = Backoff(base, cap) if rng is None else Backoff(base, cap, rng)
        self.started = False
        intake.on_drop = self._dropped_at_intake
        self._fresh_state()

    def _fresh_state(self) -> None:
        self._progress = threading.Condition()
        self._settled = 0
        self._replayed = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.send = SendLoop(
            self.outbox,
            self.sender,
            self.options,
            self.counters,
            self.backoff,
            self._stop,
            self.settle,
            self.drop,
        )
        self.batch = BatchLoop(
            self.intake,
            self.outbox,
            self.options,
            self.counters,
            self._stop,
            self.settle,
            self.drop,
            self.send.reject,
            self.stats,
            self.log_every_s,
        )
        self._next_drop_warning = 0.0
        self._unwarned_drops = 0

    # -- the calling side ------------------------------------------------------------

    def submit(self, entry: Entry | Record) -> bool:
        """Queue ``entry``; False when the queue was full and it was dropped (counted).
        Starts the threads on first use; from then on ``submit`` is the intake's ``put``
        itself, one Python call less on the training thread."""
        if not self.started:
            self.start()
        return self.intake.put(entry)

    def _dropped_at_intake(self) -> None:
        self.drop(1, QUEUE_FULL, items=1)

    def commit(self, step: int) -> None:
        """Queue the commit of ``step`` after every fragment numbered for it."""
        self.intake.commit(step)
        if not self.started:
            self.start()

    def start(self) -> None:
        with self._progress:
            if self.started:
                return
            self.started = True
            self.submit = self.intake.put  # type: ignore[method-assign]
            for name, once in (("batcher", self.batch.once), ("sender", self.send.once)):
                thread = threading.Thread(
                    target=self._loop, args=(name, once), name=f"steptally-{name}", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    def reset_after_fork(self) -> None:
        """In a forked child: no threads, no parent data; start afresh on first use."""
        self.intake.reset_after_fork()
        self.outbox.reset_after_fork()
        self.sender.reset_after_fork()
        self.counters = Counters()
        self.started = False
        self.__dict__.pop("submit", None)  # the method again, which starts the threads
        self._fresh_state()

    def replay(self) -> int:
        """Queue what a previous process left in the spool; how many parcels."""
        found = self.outbox.replay()
        if found:
            self._replayed += len(found)
            log.info(
                "steptally: replaying %d spooled batches from %s",
                len(found),
                self.outbox.spool.directory,
            )
            self.start()
        return len(found)

    @property
    def spool_dir(self) -> Path:
        return self.outbox.spool.directory

    def stats(self) -> Stats:
        return self.counters.snapshot(self.queued())

    def drop(self, fragments: int, reason: str, items: int = 0) -> None:
        """Count ``fragments`` as lost for ``reason``; warn, at most every WARN_EVERY_S."""
        self.counters.add(dropped=fragments)
        self.counters.error(reason)
        self._unwarned_drops += fragments
        now = time.monotonic()
        if now >= self._next_drop_warning:
            log.warning("steptally: dropped %d fragments: %s", self._unwarned_drops, reason)
            self._unwarned_drops = 0
            self._next_drop_warning = now + WARN_EVERY_S
        if items:
            self.settle(items)

    def settle(self, items: int) -> None:
        with self._progress:
            self._settled += items
            self._progress.notify_all()

    def flush(self, timeout: float | None) -> bool:
        """Wait until everything queued so far is delivered or given up; False on timeout."""
        target = self.intake.accepted() + self._replayed
        if self._settled >= target:
            return True
        self.start()
        self.batch.request_flush()
        with self._progress:
            return self._progress.wait_for(lambda: self._settled >= target, timeout)

    def close(self, timeout: float) -> Closed:
        """Flush for at most ``timeout`` seconds, stop both threads, and leave whatever
        is undelivered in the spool; never blocks more than CLOSE_GRACE_S longer.

        While the service is not answering there is no point in waiting long: what is
        waiting is spooled, and the next reporter of this run and rank (or ``steptally
        sync``) sends it.
        """
        if self.send.down:
            timeout = min(timeout, DOWN_CLOSE_S)
        deadline = time.monotonic() + timeout
        done = self.flush(timeout)
        self._stop.set()
        self.intake.wake.set()
        for thread in self._threads:  # the batcher hands what it holds to the outbox
            if thread.name.endswith("batcher"):
                thread.join(max(CLOSE_GRACE_S, deadline - time.monotonic()))
        moved = self.outbox.spill()  # whatever the sender will not get to
        self.counters.add(spooled=sum(p.fragments for p in moved))
        lost = self.outbox.in_memory_fragments()
        if lost:
            self.drop(
                lost,
                f"closing: {lost} fragments could not be kept (the spool at "
                f"{self.spool_dir} is full); raise max_spool_bytes",
            )
        left = self.outbox.fragments() - self.outbox.in_memory_fragments()
        if left or not done:
            log.warning(
                "steptally: closing with undelivered data; %d fragments stay in the spool "
                "at %s for the next reporter of this run and rank, or `steptally sync`",
                left,
                self.spool_dir,
            )
        for thread in self._threads:
            thread.join(max(0.0, min(CLOSE_GRACE_S, deadline - time.monotonic())))
        self.sender.close()
        return Closed(done, left, self.spool_dir, self.stats())

    def queued(self) -> int:
        return self.intake.fragments() + self.batch.held() + self.outbox.fragments()

    # -- both threads ---------------------------------------------------------------

    def _loop(self, name: str, once: Callable[[], bool]) -> None:
        """Run ``once`` until it returns False; an unexpected error is logged, not fatal."""
        while True:
            try:
                if not once():
                    return
            except Exception as exc:
                log.exception("steptally: unexpected error in the %s thread; it goes on", name)
                self.counters.error(f"{name}: {type(exc).__name__}: {exc}")
                if self._stop.wait(1.0):
                    return
