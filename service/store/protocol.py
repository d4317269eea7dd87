"""The storage interface the use cases talk to, and the plain records it returns.

:func:`~steptally.service.store.factory.open_store` builds the store that settings
describe: :mod:`.sql` (SQLite or PostgreSQL), with Redis coordination beside it when
``redis_url`` is set (:mod:`steptally.service.coordination.store`); every one
behaves alike, which ``tests/contract/`` checks. Every method that writes is one
atomic transaction: it either happens entirely or not at all, and a method returns
only once its effect is durable.

Finalisation happens inside the store's transactions (``ingest`` and ``sweep``),
under the step's lock, so each revision of a step is finalised exactly once however
many requests or instances race; the combining itself is the pure
:func:`steptally.service.domain.finalise.evaluate`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from steptally.service.domain.batch import PreparedBatch
from steptally.service.domain.finalise import StepResult, ValueState
from steptally.service.domain.packing import Cell
from steptally.service.domain.progress import Progress, StepStatus
from steptally.service.domain.run import RunDraft, RunRecord, RunSnapshot, RunSummary


@dataclass(frozen=True, slots=True)
class FinalisedStep:
    """A finalisation; ``run_record`` and ``record`` are the run and the step as
    finalised (what an event shows without reading the step back)."""

    run: str
    step: int
    status: StepStatus
    revision: int
    run_record: RunRecord | None = field(default=None, compare=False, repr=False)
    record: StepRecord | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class IngestOutcome:
    accepted: int
    duplicates: int
    commits: int
    finalised: list[FinalisedStep] = field(default_factory=list)


#: what a batch submitted from an event loop is answered with, on that loop: its outcome,
#: or the error that kept it from being stored
Answer = Callable[[IngestOutcome | None, BaseException | None], None]


@dataclass(frozen=True, slots=True)
class StepRecord:
    """A step as stored. ``result`` is None while open; an open step read with
    ``live=True`` carries its ``progress`` and ``fragments`` to evaluate on the fly.
    ``counters`` are the stored ``(ranks committed, fragments expected)``, which a
    copy of the step's progress kept elsewhere (Redis) must agree with to be used."""

    step: int
    status: StepStatus
    revision: int
    first_seen_at: float
    finalised_at: float | None
    result: StepResult | None
    progress: Progress | None = None
    fragments: Sequence[Cell] = ()
    counters: tuple[int, int] | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class SeriesRows:
    """A metric's finalised values over a range, column by column, in step order.

    ``total`` counts the finalised steps of the range; ``downsampled`` says whether
    only some of them are here. ``values[i]`` is None unless ``states[i]`` is NUMBER.
    """

    total: int
    downsampled: bool
    steps: list[int]
    values: list[float | None]
    states: list[ValueState]
    status: list[StepStatus]
    revision: list[int]


@dataclass(frozen=True, slots=True)
class BreachRecord:
    """A step that broke an alert rule: the revision that first broke it, when that was
    finalised, and the breach as the step showed it then."""

    step: int
    rule: str
    revision: int
    finalised_at: float
    breach: dict[str, Any]


Decide = Callable[[RunRecord | None], RunDraft]


class Store(Protocol):
    """Durable state of runs, fragments, commits and steps."""

    def register_run(self, name: str, decide: Decide, now: float) -> tuple[RunRecord, bool]:
        """Atomically read the run named ``name`` (None if new), let ``decide`` return
        what it becomes (or raise), and save it (created at ``now`` if new). Returns the
        run and whether it is new."""
        ...

    def get_run(self, name: str) -> RunRecord | None: ...

    def list_runs(self, after: str | None = None, limit: int | None = None) -> list[RunSummary]:
        """Runs in name order: those named after ``after``, at most ``limit`` of them."""
        ...

    def run_summary(self, name: str) -> RunSummary | None: ...

    def ingest(self, run: RunRecord, batch: PreparedBatch, now: float) -> IngestOutcome:
        """Store a batch all-or-nothing and finalise the steps it completes (or adds to
        after a partial finalisation); raises a 409 service error and changes nothing
        on a conflict."""
        ...

    def submit(self, run: RunRecord, batch: PreparedBatch, now: float) -> Future[IngestOutcome]:
        """:meth:`ingest` without waiting: a future of its outcome (or its error)."""
        ...

    def submit_call(
        self,
        run: RunRecord,
        batch: PreparedBatch,
        now: float,
        loop: asyncio.AbstractEventLoop,
        answer: Answer,
    ) -> None:
        """:meth:`ingest` without waiting or a future: ``answer`` is called on ``loop``
        with its outcome or its error (with the other batches of its group answered on
        that loop, in one call)."""
        ...

    def sweep(self, now: float, limit: int = 100) -> list[FinalisedStep]:
        """Finalise as partial the open steps whose deadline has passed."""
        ...

    def get_step(self, run: RunRecord, step: int, live: bool = True) -> StepRecord | None: ...

    def list_steps(
        self, run: RunRecord, start: int | None, end: int | None, limit: int, live: bool = True
    ) -> list[StepRecord]:
        """Steps from ``start`` to ``end`` (both inclusive, None for open ends), in order."""
        ...

    def series(
        self, run: RunRecord, col: int, start: int | None, end: int | None, points: int | None
    ) -> SeriesRows:
        """Column ``col``'s finalised values from ``start`` to ``end`` (inclusive), all
        of them or, past ``points`` steps, downsampled (see :mod:`.sql_series`)."""
        ...

    def finalised_since(
        self, run: RunRecord, after: tuple[float, int], limit: int
    ) -> list[StepRecord]:
        """Finalised steps in ``(finalised_at, step)`` order, after ``after``."""
        ...

    def newest_finalised(self, run: RunRecord) -> tuple[float, int, int] | None:
        """The last place in that order (``finalised_at``, step, revision), None before
        the run's first finalisation."""
        ...

    def breaches(
        self,
        run: RunRecord,
        start: int | None,
        end: int | None,
        rules: Sequence[str] | None,
        after: tuple[int, str] | None,
        limit: int,
    ) -> list[BreachRecord]:
        """The breaches of steps ``start`` to ``end`` (inclusive, None: open), of ``rules``
        (None: every rule), in (step, rule) order after ``after``, ``limit`` at most."""
        ...

    def exposition_snapshot(self) -> list[RunSnapshot]: ...

    def check_ready(self) -> None:
        """Raise unless the store can serve now: it answers, and its schema is the one
        this code needs (else :class:`~steptally.service.errors.NotMigrated`)."""
        ...

    def close(self) -> None: ...
