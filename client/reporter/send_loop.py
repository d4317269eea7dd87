"""The sender thread's one turn: post the oldest parcel and act on the answer.

It registers the run on first contact; on a failure that may pass it spills the
outbox to the spool and waits (capped backoff with jitter, or the server's
Retry-After) before trying the same parcel again. What becomes of each parcel is
counted: delivered (``sent``, less the items the service refused, ``rejected``),
kept on disk (``spooled``; ``quarantined`` when the service would not take it: a 4xx
for the whole body, or more than ``max_server_errors`` 5xx answers in a row, 503
aside), or lost (through ``drop``). When the run cannot be registered, or the
service refuses the token (401, 403), every parcel stays in the spool for
``steptally sync``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from steptally.client.reporter.options import ReporterOptions
from steptally.client.reporter.outbox import Outbox, Placed
from steptally.client.reporter.parcel import Parcel
from steptally.client.reporter.retry import Backoff
from steptally.client.reporter.sender import Answer, Outcome, Sender
from steptally.client.reporter.stats import Counters

log = logging.getLogger("steptally.reporter")


class SendLoop:
    def __init__(
        self,
        outbox: Outbox,
        sender: Sender,
        options: ReporterOptions,
        counters: Counters,
        backoff: Backoff,
        stop: threading.Event,
        settle: Callable[[int], None],
        drop: Callable[[int, str], None],
    ) -> None:
        self.outbox, self.sender, self.options = outbox, sender, options
        self.counters, self.backoff, self._stop = counters, backoff, stop
        self._settle, self._drop = settle, drop
        self.registered = False
        self.down = False  # the last attempt failed in a way that may pass
        self._server_errors = 0  # 5xx answers in a row to the head parcel

    def once(self) -> bool:
        got = self.outbox.head(timeout=0.2)
        if got is None:
            return not self._stop.is_set()
        parcel, body = got
        if body is None:  # its spool file vanished or cannot be read
            self._done(parcel)
            self._drop(parcel.fragments, f"the spooled batch {parcel.path} cannot be read")
        elif self.counters.failed:
            self._keep(parcel)
        elif self.registered or self._register():
            self._deliver(parcel, body)
        return not self._stop.is_set()

    def reject(self, items: int, message: str) -> None:
        self.counters.add(rejected=items)
        self.counters.error(message)
        log.error("steptally: rejected: %s", message)

    def _done(self, parcel: Parcel) -> None:
        self.outbox.pop(parcel)
        self._server_errors = 0
        self._settle(parcel.items)

    def _keep(self, parcel: Parcel) -> None:
        """Leave ``parcel`` in the spool for ``steptally sync`` (the run is unregistered)."""
        placed = self.outbox.release(parcel)
        if placed is Placed.SPOOL:
            self.counters.add(spooled=parcel.fragments)
        elif placed is Placed.DROPPED:
            self._drop(parcel.fragments, f"the spool at {self.outbox.spool.directory} is full")
        self._settle(parcel.items)

    def _quarantine(self, parcel: Parcel, body: bytes, error: str) -> None:
        where = self.outbox.quarantine(parcel, body, error)
        self._server_errors = 0
        if where is None:
            self._drop(parcel.fragments, f"a refused batch could not be kept: {error}")
        else:
            self.counters.add(quarantined=parcel.fragments)
            self.counters.error(f"{error}; the batch is kept at {where}")
            log.error("steptally: %s; the batch is kept at %s", error, where)
        self._settle(parcel.items)

    def _register(self) -> bool:
        answer = self.sender.register()
        if answer.outcome is Outcome.OK:
            self.registered = True
            return True
        if answer.outcome is Outcome.RETRY:
            self._retry(answer)
            return False
        self.counters.failed = True
        self.reject(
            0,
            f"the run {self.sender.run!r} could not be registered: {answer.message}; "
            "nothing more will be delivered by this reporter; what it holds stays in the "
            f"spool at {self.outbox.spool.directory} for `steptally sync`",
        )
        return False

    def _deliver(self, parcel: Parcel, body: bytes) -> None:
        answer = self.sender.post(body, parcel.headers())
        time.sleep(0)
        if answer.outcome is Outcome.OK:
            self._delivered(parcel, answer)
        elif answer.outcome is Outcome.UNKNOWN_RUN:
            self.registered = False
            self.counters.add(retried=1)
            log.warning("steptally: the service does not know the run; registering it again")
            self._stop.wait(self.backoff.next())
        elif answer.outcome is Outcome.DENIED:
            self._denied(parcel, answer)
        elif answer.outcome is Outcome.RETRY:
            if self._poisoned(answer):
                self._quarantine(parcel, body, f"{self._server_errors} answers {answer.message}")
            else:
                self._retry(answer)
        else:
            self.counters.add(rejected=parcel.fragments)
            self._quarantine(parcel, body, answer.message)

    def _denied(self, parcel: Parcel, answer: Answer) -> None:
        """The service refused the token (401/403): keep this parcel and every later one
        in the spool, as for a run that cannot be registered."""
        self.counters.failed = True
        self.reject(
            0,
            f"the service refused this reporter's token: {answer.message}; nothing more will "
            f"be delivered by this reporter; what it holds stays in the spool at "
            f"{self.outbox.spool.directory} for `steptally sync --token`",
        )
        self._keep(parcel)

    def _delivered(self, parcel: Parcel, answer: Answer) -> None:
        self._done(parcel)
        refused = sum(1 for r in answer.refused if r.seq is not None)
        self.counters.add(sent=parcel.fragments - refused)
        for r in answer.refused:
            what = "commit" if r.seq is None else f"fragment seq {r.seq}"
            self.reject(1, f"step {r.step} rank {r.rank} {what}: {r.code}: {r.message}")
        self.backoff.reset()
        if self.down:
            self.down = False
            log.warning(
                "steptally: the service answers again; sending %d waiting batches in order",
                len(self.outbox),
            )

    def _poisoned(self, answer: Answer) -> bool:
        """Whether the head parcel has had too many 5xx answers (503 means "away")."""
        if answer.status is None or answer.status < 500 or answer.status == 503:
            self._server_errors = 0
            return False
        self._server_errors += 1
        return self._server_errors > self.options.max_server_errors

    def _retry(self, answer: Answer) -> None:
        if not self.down:
            log.warning(
                "steptally: the service is not answering (%s); spooling to %s and retrying",
                answer.message,
                self.outbox.spool.directory,
            )
        self.down = True  # before the counters: whoever sees them sees this too
        moved = self.outbox.spill()
        self.counters.add(retried=1, spooled=sum(p.fragments for p in moved))
        self.counters.error(answer.message)
        delay = self.backoff.next(answer.retry_after, self.options.max_retry_after_s)
        self._stop.wait(delay)
