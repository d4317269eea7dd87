"""Check a decoded batch against its run and pack it for storage (pure).

A :class:`PreparedBatch` holds each distinct fragment once, keyed by
``(step, rank, seq)``, its values packed over the run's columns (see
:mod:`.cells`), and each distinct commit once, keyed by ``(step, rank)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from steptally.client.algebra import Kind
from steptally.client.wire import FragmentBatch, f64_to_le_bytes
from steptally.service.domain import cells
from steptally.service.domain.run import RunRecord
from steptally.service.errors import (
    CommitConflict,
    FragmentConflict,
    InvalidValue,
    RankOutOfRange,
    UnknownMetric,
)

FragmentKey = tuple[int, int, int]
CommitKey = tuple[int, int]


@dataclass(slots=True)
class PreparedBatch:
    fragments: dict[FragmentKey, cells.Cell] = field(default_factory=dict)
    commits: dict[CommitKey, int] = field(default_factory=dict)
    columnar: bool = False

    def steps(self) -> list[int]:
        return sorted({k[0] for k in self.fragments} | {k[0] for k in self.commits})

    def where(self, key: FragmentKey) -> str:
        """Where a fragment sits in the body, for error messages."""
        index = list(self.fragments).index(key)
        return f"columnar.step[{index}]" if self.columnar else f"fragments[{index}]"


def prepare(run: RunRecord, batch: FragmentBatch, columnar: bool) -> PreparedBatch:
    """Validate ``batch`` for ``run`` and pack it; raise a 4xx service error if it is wrong."""
    _check_metrics(run, batch, columnar)
    _check_ranks(run, batch, columnar)
    _check_counts(run, batch, columnar)
    _check_tails(run, batch, columnar)
    out = PreparedBatch(columnar=columnar)
    _pack_fragments(run, batch, out)
    for i, c in enumerate(batch.commits):
        known = out.commits.setdefault((c.step, c.rank), c.fragments)
        if known != c.fragments:
            raise CommitConflict(
                f"rank {c.rank} commits step {c.step} twice in this batch, with {known} and "
                f"{c.fragments} fragments; send one commit per rank and step",
                f"commits[{i}]",
            )
    return out


def _first_row(batch: FragmentBatch, column: int) -> int:
    m = len(batch.metrics)
    if batch.present is None:
        return 0
    return next(i for i in range(len(batch)) if batch.present[i * m + column])


def _check_metrics(run: RunRecord, batch: FragmentBatch, columnar: bool) -> None:
    for j, name in enumerate(batch.metrics):
        if name in run.column_of:
            continue
        if columnar:
            where = "columnar.metrics"
        else:
            where = f"fragments[{_first_row(batch, j)}].values.{name}"
        if name in run.spec.derived:
            why = "is a derived expression, computed by the service; send the metrics it uses"
        else:
            why = "is not in the run's spec; register it with POST /v1/runs first"
        raise UnknownMetric(f"metric {name!r} {why}", where)


def _check_ranks(run: RunRecord, batch: FragmentBatch, columnar: bool) -> None:
    for i, rank in enumerate(batch.ranks):
        if rank >= run.world_size:
            where = f"columnar.rank[{i}]" if columnar else f"fragments[{i}].rank"
            raise RankOutOfRange(_rank_message(run, rank), where)
    for i, c in enumerate(batch.commits):
        if c.rank >= run.world_size:
            raise RankOutOfRange(_rank_message(run, c.rank), f"commits[{i}].rank")


def _rank_message(run: RunRecord, rank: int) -> str:
    return (
        f"rank {rank} is out of range: run {run.name!r} has world size {run.world_size}, "
        f"so ranks are 0 to {run.world_size - 1}"
    )


def _check_counts(run: RunRecord, batch: FragmentBatch, columnar: bool) -> None:
    m = len(batch.metrics)
    for j, name in enumerate(batch.metrics):
        if run.spec.metrics[name] is not Kind.COUNT:
            continue
        column = batch.values[j::m]
        mask = None if batch.present is None else batch.present[j::m]
        for i, v in enumerate(column):
            if (mask is None or mask[i]) and not (0 <= v < math.inf and v.is_integer()):
                where = (
                    f"columnar.values[{i * m + j}]"
                    if columnar
                    else (f"fragments[{i}].values.{name}")
                )
                raise InvalidValue(
                    f"metric {name!r} is a count, so its value must be a non-negative "
                    f"integer, not {v!r}",
                    where,
                )


def _check_tails(run: RunRecord, batch: FragmentBatch, columnar: bool) -> None:
    """Only a sum's value may be an exact expansion (a count, min or max is one number)."""
    m = len(batch.metrics)
    for k, cell in enumerate(batch.tails):
        name = batch.metrics[cell % m]
        kind = run.spec.metrics[name]
        if kind is not Kind.SUM:
            where = f"columnar.tails.cells[{k}]" if columnar else f"fragments[{cell // m}]"
            raise InvalidValue(
                f"metric {name!r} is a {kind.value}, so its value is one number, not the "
                "terms of an exact sum",
                where if columnar else f"{where}.values.{name}",
            )


def _pack_fragments(run: RunRecord, batch: FragmentBatch, out: PreparedBatch) -> None:
    width = len(run.columns)
    m = len(batch.metrics)
    order = [run.column_of[name] for name in batch.metrics]
    fast = batch.present is None and order == list(range(width))
    raw = f64_to_le_bytes(batch.values) if fast else b""
    tailed = {cell // m for cell in batch.tails} if m else set()
    keys = zip(batch.steps, batch.ranks, batch.seqs, strict=True)
    for i, key in enumerate(keys):
        if fast and i not in tailed:
            cell: cells.Cell = (raw[8 * m * i : 8 * m * (i + 1)], None, None)
        else:
            cell = _pack_row(batch, i, order, width)
        known = out.fragments.setdefault(key, cell)
        if known != cell:
            raise FragmentConflict(
                f"fragment step {key[0]} rank {key[1]} seq {key[2]} appears twice in this "
                "batch with different values",
                f"columnar.step[{i}]" if out.columnar else f"fragments[{i}]",
            )


def _pack_row(batch: FragmentBatch, i: int, order: list[int], width: int) -> cells.Cell:
    m = len(batch.metrics)
    values = [0.0] * width
    mask = bytearray(width)
    row = batch.values[i * m : (i + 1) * m]
    present = batch.present
    tails = {}
    for j, col in enumerate(order):
        if present is None or present[i * m + j]:
            values[col] = row[j]
            mask[col] = 1
            tail = batch.tails.get(i * m + j)
            if tail:
                tails[col] = tail
    return cells.pack(values, mask, tails)
