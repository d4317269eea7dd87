"""Check a decoded batch against its run and pack it for storage (pure).

A :class:`PreparedBatch` holds each distinct fragment once, keyed by
``(step, rank, seq)``, its values packed over the run's columns (see
:mod:`.packing`), and each distinct commit once, keyed by ``(step, rank)``.

Strictly prepared, the first wrong item raises its 4xx error. Prepared ``partial``,
a wrong fragment or commit is left out and kept as a :class:`Rejection` (with the
error it would have raised), and the rest goes on; an error of the whole body (an
unknown metric) still raises. :meth:`PreparedBatch.reject` leaves out an item the
store refused, named by the ``where`` of the store's error.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from steptally.client.algebra import Kind
from steptally.client.wire import FragmentBatch, f64_to_le_bytes
from steptally.service.domain import packing
from steptally.service.domain.run import RunRecord
from steptally.service.errors import (
    CommitConflict,
    FragmentConflict,
    InvalidValue,
    RankOutOfRange,
    ServiceError,
    UnknownMetric,
)

FragmentKey = tuple[int, int, int]
_COUNT_BOUND = float(2**63)  # a count value, like every integer, is below 2**63
CommitKey = tuple[int, int]
_ITEM = re.compile(r"^(fragments|columnar\.step|commits)\[(\d+)\]")
# a wrong item: ("row", fragment index in the body) or ("commit", commit index)
Fault = tuple[str, int, ServiceError]


@dataclass(frozen=True, slots=True)
class Rejection:
    """One fragment (``seq`` set) or commit (``seq`` None) left out, and why."""

    where: str
    step: int
    rank: int
    seq: int | None
    code: str
    message: str


@dataclass(slots=True)
class PreparedBatch:
    fragments: dict[FragmentKey, packing.Cell] = field(default_factory=dict)
    commits: dict[CommitKey, int] = field(default_factory=dict)
    columnar: bool = False
    rejected: list[Rejection] = field(default_factory=list)
    # each item's index in the body (its first occurrence), and back
    origin: dict[FragmentKey, int] = field(default_factory=dict)
    commit_origin: dict[CommitKey, int] = field(default_factory=dict)
    # per (step, rank): how many fragments, and the stored form of their exact partial
    # state (:func:`steptally.service.domain.partial.states_of`), computed before the
    # store's transaction; a pair left out is computed there
    states: dict[CommitKey, tuple[int, bytes]] = field(default_factory=dict)
    # the pairs in their plainest shape (:func:`plain_of`): per (step, rank), its count
    # and its fragments' values joined in seq order; set with :meth:`set_plain`
    plain: dict[CommitKey, tuple[int, bytes]] = field(default_factory=dict)
    plain_fragments: int = 0  # how many fragments the plain pairs hold

    def steps(self) -> list[int]:
        if self.is_plain():
            return sorted({s for s, _ in self.plain})
        return sorted({k[0] for k in self.fragments} | {k[0] for k in self.commits})

    def pairs(self) -> set[CommitKey]:
        """The (step, rank) pairs the batch's fragments and commits belong to."""
        if self.is_plain():
            return set(self.plain)
        return {k[:2] for k in self.fragments} | set(self.commits)

    def set_plain(self, plain: dict[CommitKey, tuple[int, bytes]]) -> None:
        """Keep ``plain``: pairs of the batch (:func:`plain_of`), each one it commits and
        holds every fragment of."""
        self.plain = plain
        self.plain_fragments = sum(n for n, _ in plain.values())

    def is_plain(self) -> bool:
        """Whether every pair of the batch is plain (:func:`plain_of`): what a reporter
        sends, and what the store's rules and rows then take a pair at a time instead of
        a fragment at a time. A commit or fragment left out since makes it not. (The
        plain pairs are committed pairs whose fragments the batch holds, so as many of
        them as commits, holding as many fragments as the batch, are all of it.)"""
        return len(self.plain) == len(self.commits) and self.plain_fragments == len(self.fragments)

    def __bool__(self) -> bool:
        return bool(self.fragments or self.commits)

    def where(self, key: FragmentKey) -> str:
        """Where a fragment sits in the body, for error messages."""
        index = self.origin.get(key, 0)
        return f"columnar.step[{index}]" if self.columnar else f"fragments[{index}]"

    def commit_where(self, key: CommitKey) -> str:
        return f"commits[{self.commit_origin.get(key, 0)}]"

    def reject(self, error: ServiceError) -> bool:
        """Leave out the item that ``error`` names by its ``where``; False if none."""
        m = _ITEM.match(error.where or "")
        if m is None:
            return False
        index = int(m[2])
        self.set_plain({})  # what is left is no longer what the pairs were
        if m[1] == "commits":
            ckey = next((k for k, i in self.commit_origin.items() if i == index), None)
            if ckey is None or self.commits.pop(ckey, None) is None:
                return False
            self.rejected.append(_rejection(error, ckey[0], ckey[1], None))
            return True
        fkey = next((k for k, i in self.origin.items() if i == index), None)
        if fkey is None or self.fragments.pop(fkey, None) is None:
            return False
        self.rejected.append(_rejection(error, *fkey))
        return True


def merge(batches: Sequence[PreparedBatch]) -> PreparedBatch | None:
    """One batch holding every fragment and commit of ``batches``, when no two of them
    share a (step, rank) pair (then nothing one of them stores is read by the rules of
    another); None when two do."""
    out = PreparedBatch()
    seen: set[CommitKey] = set()
    for batch in batches:
        pairs = batch.pairs()
        if not pairs.isdisjoint(seen):
            return None
        seen |= pairs
        out.fragments.update(batch.fragments)
        out.commits.update(batch.commits)
        out.states.update(batch.states)
        out.plain.update(batch.plain)
        out.plain_fragments += batch.plain_fragments
    return out


def plain_of(
    fragments: dict[FragmentKey, packing.Cell], commits: dict[CommitKey, int]
) -> dict[CommitKey, tuple[int, bytes]]:
    """The plain pairs of a batch, in the order their first fragments come: those it
    commits with ``n`` >= 1 fragments and holds all of, seqs 0 to ``n`` - 1, each a full
    row (no mask, no tails) of one size; per pair, ``n`` and the values joined in seq
    order (the stored bundle's, :func:`~.packing.bundled`)."""
    by_pair: dict[CommitKey, list[tuple[int, packing.Cell]]] = {}
    for (s, r, q), cell in fragments.items():
        by_pair.setdefault((s, r), []).append((q, cell))
    out: dict[CommitKey, tuple[int, bytes]] = {}
    for pair, cells in by_pair.items():
        n = commits.get(pair)
        if n != len(cells):
            continue
        cells.sort(key=lambda c: c[0])
        size = len(cells[0][1][0])
        if all(
            q == i and len(v) == size and p is None and t is None
            for i, (q, (v, p, t)) in enumerate(cells)
        ):
            out[pair] = (n, b"".join(v for _, (v, _, _) in cells))
    return out


def _rejection(error: ServiceError, step: int, rank: int, seq: int | None) -> Rejection:
    return Rejection(error.where or "", step, rank, seq, error.code, error.message)


def prepare(
    run: RunRecord, batch: FragmentBatch, columnar: bool, partial: bool = False
) -> PreparedBatch:
    """Validate ``batch`` for ``run`` and pack it; raise a 4xx service error if it is
    wrong (``partial``: only if the whole body is, leaving out and noting wrong items)."""
    _check_metrics(run, batch, columnar)
    faults: dict[tuple[str, int], ServiceError] = {}
    for check in (_check_ranks, _check_counts, _check_tails):
        _note(faults, check(run, batch, columnar), partial)
    out = PreparedBatch(columnar=columnar)
    skip = {i for kind, i in faults if kind == "row"}
    _note(faults, _pack_fragments(run, batch, out, skip), partial)
    _note(faults, _pack_commits(batch, out, {i for kind, i in faults if kind == "commit"}), partial)
    for (kind, i), error in sorted(faults.items(), key=lambda f: (f[0][0] != "row", f[0][1])):
        if kind == "row":
            out.rejected.append(_rejection(error, batch.steps[i], batch.ranks[i], batch.seqs[i]))
        else:
            c = batch.commits[i]
            out.rejected.append(_rejection(error, c.step, c.rank, None))
    return out


def _note(
    faults: dict[tuple[str, int], ServiceError], found: Iterator[Fault], partial: bool
) -> None:
    """Raise the first fault, or (``partial``) keep each item's first."""
    for kind, i, error in found:
        if not partial:
            raise error
        faults.setdefault((kind, i), error)


def _pack_commits(batch: FragmentBatch, out: PreparedBatch, skip: set[int]) -> Iterator[Fault]:
    for i, c in enumerate(batch.commits):
        if i in skip:
            continue
        key = (c.step, c.rank)
        known = out.commits.setdefault(key, c.fragments)
        out.commit_origin.setdefault(key, i)
        if known != c.fragments:
            yield (
                "commit",
                i,
                CommitConflict(
                    f"rank {c.rank} commits step {c.step} twice in this batch, with {known} "
                    f"and {c.fragments} fragments; send one commit per rank and step",
                    f"commits[{i}]",
                ),
            )


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


def _check_ranks(run: RunRecord, batch: FragmentBatch, columnar: bool) -> Iterator[Fault]:
    for i, rank in enumerate(batch.ranks):
        if rank >= run.world_size:
            where = f"columnar.rank[{i}]" if columnar else f"fragments[{i}].rank"
            yield "row", i, RankOutOfRange(_rank_message(run, rank), where)
    for i, c in enumerate(batch.commits):
        if c.rank >= run.world_size:
            yield "commit", i, RankOutOfRange(_rank_message(run, c.rank), f"commits[{i}].rank")


def _rank_message(run: RunRecord, rank: int) -> str:
    return (
        f"rank {rank} is out of range: run {run.name!r} has world size {run.world_size}, "
        f"so ranks are 0 to {run.world_size - 1}"
    )


def _check_counts(run: RunRecord, batch: FragmentBatch, columnar: bool) -> Iterator[Fault]:
    m = len(batch.metrics)
    for j, name in enumerate(batch.metrics):
        if run.spec.metrics[name] is not Kind.COUNT:
            continue
        column = batch.values[j::m]
        mask = None if batch.present is None else batch.present[j::m]
        if mask is None and _counts(column):
            continue
        for i, v in enumerate(column):
            if (mask is None or mask[i]) and not (0 <= v < _COUNT_BOUND and v.is_integer()):
                where = (
                    f"columnar.values[{i * m + j}]"
                    if columnar
                    else (f"fragments[{i}].values.{name}")
                )
                yield (
                    "row",
                    i,
                    InvalidValue(
                        f"metric {name!r} is a count, so its value must be an integer "
                        f"from 0 to 2**63 - 1, not {v!r}",
                        where,
                    ),
                )


def _counts(column: Sequence[float]) -> bool:
    """Whether every value is a count: an integer from 0 to 2**63 - 1 (NaN and ±inf
    are not integers)."""
    return not column or (
        all(map(float.is_integer, column)) and min(column) >= 0 and max(column) < _COUNT_BOUND
    )


def _check_tails(run: RunRecord, batch: FragmentBatch, columnar: bool) -> Iterator[Fault]:
    """Only a sum's value may be an exact expansion (a count, min or max is one number)."""
    m = len(batch.metrics)
    for k, cell in enumerate(batch.tails):
        name = batch.metrics[cell % m]
        kind = run.spec.metrics[name]
        if kind is not Kind.SUM:
            where = f"columnar.tails.cells[{k}]" if columnar else f"fragments[{cell // m}]"
            yield (
                "row",
                cell // m,
                InvalidValue(
                    f"metric {name!r} is a {kind.value}, so its value is one number, not the "
                    "terms of an exact sum",
                    where if columnar else f"{where}.values.{name}",
                ),
            )


def _pack_fragments(
    run: RunRecord, batch: FragmentBatch, out: PreparedBatch, skip: set[int]
) -> Iterator[Fault]:
    width = len(run.columns)
    m = len(batch.metrics)
    order = [run.column_of[name] for name in batch.metrics]
    fast = batch.present is None and order == list(range(width))
    raw = f64_to_le_bytes(batch.values) if fast else b""
    tailed = {cell // m for cell in batch.tails} if m else set()
    keys = list(zip(batch.steps, batch.ranks, batch.seqs, strict=True))
    if fast and not tailed and not skip and len(set(keys)) == len(keys):
        # the reporter's batch: each fragment once, its row already in the run's order
        size = 8 * m
        out.fragments.update(
            (key, (raw[size * i : size * (i + 1)], None, None)) for i, key in enumerate(keys)
        )
        out.origin.update((key, i) for i, key in enumerate(keys))
        return
    for i, key in enumerate(keys):
        if i in skip:
            continue
        if fast and i not in tailed:
            cell: packing.Cell = (raw[8 * m * i : 8 * m * (i + 1)], None, None)
        else:
            cell = _pack_row(batch, i, order, width)
        known = out.fragments.setdefault(key, cell)
        out.origin.setdefault(key, i)
        if known != cell:
            where = f"columnar.step[{i}]" if out.columnar else f"fragments[{i}]"
            yield (
                "row",
                i,
                FragmentConflict(
                    f"fragment step {key[0]} rank {key[1]} seq {key[2]} appears twice in "
                    "this batch with different values",
                    where,
                ),
            )


def _pack_row(batch: FragmentBatch, i: int, order: list[int], width: int) -> packing.Cell:
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
    return packing.pack(values, mask, tails)
