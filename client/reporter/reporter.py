"""The reporter: the one object a training loop talks to.

reporter = Reporter(url, run="grpo-8b", spec=loss.metric_spec())
for step in steps:
    for mb in microbatches:
        reporter.log(step, fragments)   # returns at once; no device sync
    reporter.commit(step)
reporter.close()                        # flushes; also at interpreter exit
"""

from __future__ import annotations

import atexit
import os
import re
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from steptally.client.algebra import MetricSpec
from steptally.client.reporter.capture import Capture, check_step
from steptally.client.reporter.errors import ReporterClosed
from steptally.client.reporter.identity import resolve_identity
from steptally.client.reporter.intake import Intake
from steptally.client.reporter.options import ReporterOptions, default_spool_dir
from steptally.client.reporter.outbox import Outbox
from steptally.client.reporter.sender import Sender
from steptally.client.reporter.spool import Spool
from steptally.client.reporter.stats import Closed, Stats
from steptally.client.reporter.worker import Worker

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
GiB = 1 << 30

# Every open reporter, held strongly: one that the program dropped without close() is
# still flushed at exit, and started afresh in a forked child.
_live: set[Reporter] = set()


def _env_token() -> str | None:
    """``STEPTALLY_TOKEN``, the token when none is given."""
    return os.environ.get("STEPTALLY_TOKEN") or None


class Reporter:
    """Posts a rank's fragments and commits to a Steptally service, in the background.

    ``log()`` and ``commit()`` return at once and never raise for a delivery problem;
    they raise :class:`~steptally.client.reporter.errors.FragmentError` at once for a
    programming error they can see at once (see :meth:`log` for which checks of a
    later fragment run in the background). Delivery is batched, retried, and spooled
    to ``spool_dir`` while the service is away; see :meth:`stats` for what happened.
    ``token`` (else the ``STEPTALLY_TOKEN`` environment variable) is sent as
    ``Authorization: Bearer``; a service that refuses it (401, 403) gets nothing more,
    and the spool keeps it all.
    """

    def __init__(
        self,
        url: str,
        *,
        run: str,
        spec: MetricSpec | Mapping[str, Any],
        rank: int | None = None,
        world_size: int | None = None,
        token: str | None = None,
        step_timeout_s: float = 300.0,
        transport: httpx.BaseTransport | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
        max_spool_bytes: int = 1 * GiB,
        log_every_s: float | None = None,
        options: ReporterOptions | None = None,
    ) -> None:
        if not isinstance(run, str) or not RUN_NAME.fullmatch(run):
            raise ValueError(f"run name {run!r} is invalid: use letters, digits, '_', '.', '-'")
        spec = spec if isinstance(spec, MetricSpec) else MetricSpec.from_json(spec)
        identity = resolve_identity(rank, world_size)
        options = options or ReporterOptions()
        self.url, self.run, self.spec = url, run, spec
        self.rank, self.world_size = identity.rank, identity.world_size
        self._capture = Capture(spec.metrics)
        registration = {
            "name": run,
            "world_size": self.world_size,
            **spec.to_json(),
            "step_timeout_s": step_timeout_s,
        }
        directory = Path(spool_dir) if spool_dir else default_spool_dir(url, run, self.rank)
        Spool(directory, max_spool_bytes).check()  # an unusable folder is an OSError now
        intake = Intake(self.rank, options.max_queue_items, options.max_queue_bytes, self._capture)
        self._worker = Worker(
            intake,
            Outbox(Spool(directory, max_spool_bytes, registration), options.max_queue_bytes),
            Sender(url, run, registration, token or _env_token(), transport, options.timeout_s),
            options,
            log_every_s,
        )
        self._exit_timeout = options.exit_timeout_s
        self._closed = False
        self._last_close = Closed(True, 0, directory, Stats())
        _live.add(self)
        self._worker.replay()
        # from here on ``log`` is the intake's one-frame log(), which calls the method
        # below for what it does not take itself (see Intake.logger)
        self.log = intake.logger(self.log)  # type: ignore[method-assign,assignment]

    @property
    def spool_dir(self) -> Path:
        return self._worker.spool_dir

    def log(self, step: int, fragments: Mapping[str, Any]) -> None:
        """Queue one fragment (typically one microbatch) of ``step``; returns at once.

        Values are floats, ints or one-element tensors on any device; a CUDA tensor is
        copied to pinned host memory without waiting, and read in the background.

        Raises :class:`~steptally.client.reporter.errors.FragmentError` at once for a
        bad step, a step already committed, a value that is neither a number nor a
        tensor, and every error of the first fragment of each size (number of
        metrics) and kind (numbers, or host tensors). The rest of a later fragment's
        checks (its names, counts, bools, tensor shapes and dtypes) run on the
        background thread, off the training thread's time: a fragment failing one is
        refused there, counted in ``stats().rejected`` and logged with its step, rank
        and reason, and its step shows as incomplete.
        """
        if self._closed:
            raise ReporterClosed("log() after close(); create a new Reporter")
        if type(step) is not int or step < 0:
            step = check_step(step)
        self._worker.submit(self._capture(step, fragments))

    def commit(self, step: int) -> None:
        """Declare ``step`` done for this rank: it sent one fragment per log() call."""
        if self._closed:
            raise ReporterClosed("commit() after close(); create a new Reporter")
        self._worker.commit(check_step(step))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything logged so far is delivered (or given up for good).

        True when it was; False after ``timeout`` seconds with data still waiting.
        """
        if self._closed:
            return self._worker.queued() == 0
        return self._worker.flush(timeout)

    def close(self, timeout: float | None = None) -> Closed:
        """Flush for at most ``timeout`` seconds (default ``exit_timeout_s``, 10 s; 1 s
        while the service is not answering), then stop; what is still undelivered stays
        in the spool for the next reporter of this run and rank, or ``steptally sync``.
        Returns what happened (:class:`Closed`: true when everything was delivered);
        blocks at most a quarter of a second longer than ``timeout``."""
        if self._closed:
            return self._last_close
        self._closed = True
        self.__dict__.pop("log", None)  # the method again, which refuses
        _live.discard(self)
        closed = self._worker.close(self._exit_timeout if timeout is None else timeout)
        self._last_close = closed
        return closed

    def stats(self) -> Stats:
        """Counters of what was sent, retried, spooled, dropped, queued and rejected."""
        return self._worker.stats()

    def __enter__(self) -> Reporter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Reporter({self.url!r}, run={self.run!r}, rank={self.rank}/{self.world_size})"

    def _after_fork_in_child(self) -> None:
        self._worker.reset_after_fork()


def _close_all_at_exit() -> None:
    for reporter in list(_live):
        reporter.close()


def _after_fork_in_child() -> None:
    for reporter in list(_live):
        reporter._after_fork_in_child()


atexit.register(_close_all_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
