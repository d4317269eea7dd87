"""What the reporter did: counts of fragments, and the last error, for people and tests;
and what :meth:`Reporter.close` did."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Stats:
    """A snapshot of the reporter's counters, in fragments (not batches).

    ``sent``: acknowledged by the service. ``retried``: failed attempts that will be
    made again (counted per attempt, not per fragment). ``spooled``: written to the
    local spool. ``dropped``: lost because memory and spool were both full.
    ``queued``: waiting now, in memory or in the spool. ``rejected``: refused for good
    (a 4xx answer, a spec conflict, an invalid device value; and each fragment or
    commit the service left out of a delivered batch, logged once with its step, rank
    and error code, never retried). ``quarantined``: kept in the spool's quarantine
    because the service would not take the batch (see :mod:`.spool`). ``failed``: the run could
    not be registered, so nothing more will be delivered.
    """

    sent: int = 0
    retried: int = 0
    spooled: int = 0
    dropped: int = 0
    queued: int = 0
    rejected: int = 0
    last_error: str | None = None
    failed: bool = False
    quarantined: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """One log line."""
        text = (
            f"sent={self.sent} queued={self.queued} spooled={self.spooled} "
            f"retried={self.retried} rejected={self.rejected} dropped={self.dropped}"
            + (f" quarantined={self.quarantined}" if self.quarantined else "")
        )
        if self.failed:
            text += " FAILED"
        return text + (f" last_error={self.last_error!r}" if self.last_error else "")


@dataclass(frozen=True, slots=True)
class Closed:
    """What :meth:`Reporter.close` did; true when everything was delivered.

    ``delivered``: nothing logged is waiting (all sent, or refused for good).
    ``left``: fragments left in the spool at ``spool_dir``, for the next reporter of
    this run and rank or ``steptally sync``. ``stats``: the counters at the end (their
    ``sent``, ``spooled``, ``dropped``, ``rejected`` and ``quarantined``).
    """

    delivered: bool
    left: int
    spool_dir: Path
    stats: Stats

    def __bool__(self) -> bool:
        return self.delivered


class Counters:
    """Thread-safe running totals behind :class:`Stats`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent = self.retried = self.spooled = self.dropped = self.rejected = 0
        self.quarantined = 0
        self.last_error: str | None = None
        self.failed = False

    def reset_after_fork(self) -> None:
        self._lock = threading.Lock()

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def error(self, message: str) -> None:
        self.last_error = message

    def snapshot(self, queued: int) -> Stats:
        with self._lock:
            return Stats(
                self.sent,
                self.retried,
                self.spooled,
                self.dropped,
                queued,
                self.rejected,
                self.last_error,
                self.failed,
                self.quarantined,
            )
