"""The background side: one thread batches, one thread sends.

The *batcher* thread drains the intake, waits for device values, cuts batches and
puts them in the outbox; it never touches the network, so the intake keeps draining
into memory or the spool however slow the service is. The *sender* thread posts the
oldest parcel, registers the run on first contact, and on a failure that may pass
spills the outbox to the spool and waits (capped backoff with jitter, or the server's
Retry-After) before trying the same parcel again. Both threads are daemons, started
lazily and started again in a forked child.

Nothing leaves without being counted: a parcel is delivered (``sent``, less the items
the service refused, ``rejected``), kept on disk (``spooled``; ``quarantined`` when the
service would not take it: a 4xx for the whole body, or more than
``max_server_errors`` 5xx answers in a row), or lost (``dropped``, with the reason in
``last_error`` and a warning at most every ``WARN_EVERY_S``). When the run cannot be
registered, every parcel stays in the spool for ``steptally sync``.
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
from steptally.client.reporter.parcel import Parcel, encode
from steptally.client.reporter.retry import Backoff
from steptally.client.reporter.sender import Answer, Outcome, Sender
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
        self.registered = False
        self.started = False
        self._fresh_state()

    def _fresh_state(self) -> None:
        self._progress = threading.Condition()
        self._settled = 0
        self._replayed = 0
        self._flush_gen = self._served_gen = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._down = False
        self._next_line = time.monotonic() + (self.log_every_s or 0)
        self._server_errors = 0  # 5xx answers in a row to the head parcel
        self._next_drop_warning = 0.0
        self._unwarned_drops = 0

    # -- the calling side ------------------------------------------------------------

    def start(self) -> None:
        with self._progress:
            if self.started:
                return
            self.started = True
            for name, once in (("batcher", self._batch_once), ("sender", self._send_once)):
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
        if self._down:
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
                self._reject(1, f"rank {self.intake.rank} step {item.step}: {reason}")
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

    def _reject(self, fragments: int, message: str) -> None:
        self.counters.add(rejected=fragments)
        self.counters.error(message)
        log.error("steptally: rejected: %s", message)

    # -- the sender thread -------------------------------------------------------------

    def _send_once(self) -> bool:
        got = self.outbox.head(timeout=0.2)
        if got is None:
            return not self._stop.is_set()
        parcel, body = got
        if body is None:  # its spool file vanished or cannot be read
            self._done(parcel)
            self.drop(parcel.fragments, f"the spooled batch {parcel.path} cannot be read")
        elif self.counters.failed:
            self._keep(parcel)
        elif self.registered or self._register():
            self._deliver(parcel, body)
        return not self._stop.is_set()

    def _done(self, parcel: Parcel) -> None:
        self.outbox.pop(parcel)
        self._server_errors = 0
        self.settle(parcel.items)

    def _keep(self, parcel: Parcel) -> None:
        """Leave ``parcel`` in the spool for ``steptally sync`` (the run is unregistered)."""
        placed = self.outbox.release(parcel)
        if placed is Placed.SPOOL:
            self.counters.add(spooled=parcel.fragments)
        elif placed is Placed.DROPPED:
            self.drop(parcel.fragments, f"the spool at {self.spool_dir} is full")
        self.settle(parcel.items)

    def _quarantine(self, parcel: Parcel, body: bytes, error: str) -> None:
        where = self.outbox.quarantine(parcel, body, error)
        self._server_errors = 0
        if where is None:
            self.drop(parcel.fragments, f"a refused batch could not be kept: {error}")
        else:
            self.counters.add(quarantined=parcel.fragments)
            self.counters.error(f"{error}; the batch is kept at {where}")
            log.error("steptally: %s; the batch is kept at %s", error, where)
        self.settle(parcel.items)

    def _register(self) -> bool:
        answer = self.sender.register()
        if answer.outcome is Outcome.OK:
            self.registered = True
            return True
        if answer.outcome is Outcome.RETRY:
            self._retry(answer)
            return False
        self.counters.failed = True
        self._reject(
            0,
            f"the run {self.sender.run!r} could not be registered: {answer.message}; "
            "nothing more will be delivered by this reporter; what it holds stays in the "
            f"spool at {self.spool_dir} for `steptally sync`",
        )
        return False

    def _deliver(self, parcel: Parcel, body: bytes) -> None:
        answer = self.sender.post(body, parcel.headers())
        time.sleep(0)
        if answer.outcome is Outcome.OK:
            self._done(parcel)
            refused = sum(1 for r in answer.refused if r.seq is not None)
            self.counters.add(sent=parcel.fragments - refused)
            for r in answer.refused:
                what = "commit" if r.seq is None else f"fragment seq {r.seq}"
                self._reject(1, f"step {r.step} rank {r.rank} {what}: {r.code}: {r.message}")
            self.backoff.reset()
            if self._down:
                self._down = False
                log.warning(
                    "steptally: the service answers again; sending %d waiting batches in order",
                    len(self.outbox),
                )
        elif answer.outcome is Outcome.UNKNOWN_RUN:
            self.registered = False
            self.counters.add(retried=1)
            log.warning("steptally: the service does not know the run; registering it again")
            self._stop.wait(self.backoff.next())
        elif answer.outcome is Outcome.RETRY:
            if self._poisoned(answer):
                self._quarantine(parcel, body, f"{self._server_errors} answers {answer.message}")
            else:
                self._retry(answer)
        else:
            self.counters.add(rejected=parcel.fragments)
            self._quarantine(parcel, body, answer.message)

    def _poisoned(self, answer: Answer) -> bool:
        """Whether the head parcel has had too many 5xx answers (503 means "away")."""
        if answer.status is None or answer.status < 500 or answer.status == 503:
            self._server_errors = 0
            return False
        self._server_errors += 1
        return self._server_errors > self.options.max_server_errors

    def _retry(self, answer: Answer) -> None:
        if not self._down:
            log.warning(
                "steptally: the service is not answering (%s); spooling to %s and retrying",
                answer.message,
                self.outbox.spool.directory,
            )
        self._down = True  # before the counters: whoever sees them sees this too
        moved = self.outbox.spill()
        self.counters.add(retried=1, spooled=sum(p.fragments for p in moved))
        self.counters.error(answer.message)
        delay = self.backoff.next(answer.retry_after, self.options.max_retry_after_s)
        self._stop.wait(delay)
