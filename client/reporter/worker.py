"""The background side: one thread batches, one thread sends.

The *batcher* thread drains the intake, waits for device values, cuts batches and
puts them in the outbox; it never touches the network, so the intake keeps draining
into memory or the spool however slow the service is. The *sender* thread runs
:class:`~.send_loop.SendLoop`. Both threads are daemons, started lazily and started
again in a forked child; ``start``, ``flush``, ``close`` and the fork are here.

Nothing is lost without being counted: :meth:`Worker.drop` counts it in ``dropped``,
with the reason in ``last_error`` and a warning at most every ``WARN_EVERY_S``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from steptally.client.reporter.batcher import Batcher
from steptally.client.reporter.capture import Entry
from steptally.client.reporter.intake import Intake
from steptally.client.reporter.options import ReporterOptions
from steptally.client.reporter.outbox import Outbox, Placed
from steptally.client.reporter.parcel import encode
from steptally.client.reporter.retry import Backoff
from steptally.client.reporter.send_loop import SendLoop
from steptally.client.reporter.sender import Sender
from steptally.client.reporter.stats import Closed, Counters, Stats
from steptally.client.wire import Commit, FragmentBatch

log = logging.getLogger("steptally.reporter")
YIELD_EVERY = 32  # queue items the batcher handles between offers of the GIL
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
        self.batcher = Batcher(intake.rank, options)
        self.started = False
        self._fresh_state()

    def _fresh_state(self) -> None:
        self._progress = threading.Condition()
        self._settled = 0
        self._replayed = 0
        self._flush_gen = self._served_gen = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._next_line = time.monotonic() + (self.log_every_s or 0)
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
        self._next_drop_warning = 0.0
        self._unwarned_drops = 0

    # -- the calling side ------------------------------------------------------------

    def start(self) -> None:
        with self._progress:
            if self.started:
                return
            self.started = True
            for name, once in (("batcher", self._batch_once), ("sender", self.send.once)):
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
        self.batcher = Batcher(self.intake.rank, self.options)
        self.started = False
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
        target = self.intake.items + self._replayed
        if self._settled >= target:
            return True
        self.start()
        self._flush_gen += 1
        self.intake.wake.set()
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
        return self.intake.fragments() + len(self.batcher.entries) + self.outbox.fragments()

    # -- the batcher thread ------------------------------------------------------------

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

    def _batch_once(self) -> bool:
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
            log.info("steptally: %s", self.counters.snapshot(self.queued()).line())
            self._next_line = now + self.log_every_s
        poll = max(0.01, self.options.flush_interval_s / 2)
        deadline = self.batcher.deadline()
        self.intake.wake.wait(poll if deadline is None else min(poll, max(0.0, deadline - now)))
        self.intake.wake.clear()
        return True

    def _take(self, item: Entry | Commit) -> None:
        now = time.monotonic()
        if isinstance(item, Entry) and item.staged is not None:
            reason = item.resolve()
            if reason is not None:
                self.send.reject(1, f"rank {self.intake.rank} step {item.step}: {reason}")
                self.batcher.settle_dropped(now)
                return
        self.batcher.add(item, now)
        if self.batcher.due(now):
            self._ship()

    def _ship(self) -> None:
        commits = self.batcher.commits
        parcel = self.batcher.cut()
        if parcel is None:
            return
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
            self.drop(parcel.fragments, message)
            if commits:  # a few bytes, and they make the loss visible on the service
                batch = FragmentBatch(commits=commits)
                self.outbox.put(encode(batch, self.options.gzip_min_bytes, 0), force=True)
            self.settle(parcel.items)
