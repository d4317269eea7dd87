"""A registered run as the service sees it: its spec and its metric columns; what a
registration wants it to be (:class:`RunDraft`); its steps at a glance
(:class:`RunSummary`); and what ``/metrics`` shows of it (:class:`RunSnapshot`)."""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from steptally.client.algebra import Kind, MetricSpec
from steptally.service.domain.progress import StepStatus

RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", re.ASCII)
#: a metric kind's code in a stored partial state (:mod:`.partial`)
KIND_CODES = {Kind.SUM: 0, Kind.COUNT: 1, Kind.MIN: 2, Kind.MAX: 3}


@dataclass(frozen=True)
class RunRecord:
    """A run: ``columns[i]`` is the metric stored in column ``i`` of a fragment's blob.

    Columns are append-only: a metric added later gets the next column, and a blob
    written before it simply ends earlier. A derived value has a column too, for its
    stored per-step values only: ``derived_columns[i]`` is column ``-1 - i``.
    """

    id: int
    name: str
    world_size: int
    spec: MetricSpec
    step_timeout_s: float
    created_at: float
    columns: tuple[str, ...] = field(default=())
    derived_columns: tuple[str, ...] = field(default=())

    @cached_property
    def column_of(self) -> Mapping[str, int]:
        return {name: i for i, name in enumerate(self.columns)}

    @cached_property
    def value_column_of(self) -> Mapping[str, int]:
        """The column of every metric and derived value (derived ones negative)."""
        derived = {name: -1 - i for i, name in enumerate(self.derived_columns)}
        return {**self.column_of, **derived}

    @cached_property
    def layout(self) -> tuple[bytes, bytes]:
        """Each column's kind code (a byte, :data:`KIND_CODES`) and guard column (an
        int32, -1 for none), as the compiled partial states take them."""
        kinds = bytes(KIND_CODES[self.spec.metrics[name]] for name in self.columns)
        guards = [-1] * len(self.columns)
        for metric, guard in self.spec.guards.items():
            guards[self.column_of[metric]] = self.column_of[guard]
        return kinds, struct.pack(f"<{len(guards)}i", *guards)


@dataclass(frozen=True, slots=True)
class RunDraft:
    """What a registration wants a run to be; the store assigns id, columns and time."""

    world_size: int
    spec: MetricSpec
    step_timeout_s: float


@dataclass(frozen=True, slots=True)
class RunSummary:
    run: RunRecord
    last_finalised_step: int | None
    open: int
    complete: int
    partial: int
    last_finalised_at: float | None = None
    breaches: Mapping[str, int] = field(default_factory=dict)  # steps per alert rule


@dataclass(frozen=True, slots=True)
class RunSnapshot:
    """One run for a Prometheus collector: the latest finalised step and the backlog."""

    run: str
    world_size: int
    last_step: int | None
    last_status: StepStatus | None
    last_revision: int
    values: Mapping[str, float | None]
    open_steps: int
    partial_steps: int
    missing_ranks: int  # summed over the partial steps
    # when the run was registered or last finalised a step, whichever is later
    active_at: float = field(default=0.0, compare=False)
    # steps that broke each alert rule of the run (every rule, 0 included)
    breaches: Mapping[str, int] = field(default_factory=dict)
    # the lowest open step: when it was first seen, and how many ranks it still misses
    open_since: float | None = None
    open_missing_ranks: int | None = None


def is_run_name(name: str) -> bool:
    return isinstance(name, str) and RUN_NAME.fullmatch(name) is not None
