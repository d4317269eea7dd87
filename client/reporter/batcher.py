"""Cutting the queue's entries and commits into batches by count, bytes and time.

The batcher only cuts; :func:`~.parcel.encode` turns a batch into the body that is
posted.
"""

from __future__ import annotations

from array import array
from typing import NamedTuple

from steptally.client.reporter.capture import Entry
from steptally.client.reporter.options import ReporterOptions
from steptally.client.wire import Commit, FragmentBatch

ENTRY_OVERHEAD = 32  # bytes of a fragment besides its values: step, rank, seq, mask


def entry_bytes(entry: Entry) -> int:
    tails = sum(map(len, entry.tails.values())) if entry.tails else 0
    return 8 * (len(entry.values) + tails) + ENTRY_OVERHEAD


class Cut(NamedTuple):
    """A batch, and how many queue items (log() and commit() calls) it settles."""

    batch: FragmentBatch
    items: int


class Batcher:
    """Accumulates fragments and commits in arrival order until a batch is due.

    A commit always lands in the same batch as, or a later batch than, every fragment
    it counts, because entries and commits are kept in the order they were queued.
    """

    def __init__(self, rank: int, options: ReporterOptions) -> None:
        self.rank = rank
        self.options = options
        self.entries: list[Entry] = []
        self.commits: list[Commit] = []
        self.items = 0
        self.nbytes = 0
        self.started: float | None = None

    def __len__(self) -> int:
        return self.items

    def add(self, item: Entry | Commit, now: float) -> None:
        if self.started is None:
            self.started = now
        self.items += 1
        if isinstance(item, Commit):
            self.commits.append(item)
        else:
            self.entries.append(item)
            self.nbytes += entry_bytes(item)

    def settle_dropped(self, now: float) -> None:
        """Count an item that will not be sent (it still settles with this batch)."""
        if self.started is None:
            self.started = now
        self.items += 1

    def deadline(self) -> float | None:
        """When the current batch is due by time, or None while it is empty."""
        return None if self.started is None else self.started + self.options.flush_interval_s

    def due(self, now: float) -> bool:
        if self.started is None:
            return False
        o = self.options
        return (
            len(self.entries) >= o.max_batch_fragments
            or self.nbytes >= o.max_batch_bytes
            or now >= self.started + o.flush_interval_s
        )

    def cut(self) -> Cut | None:
        """The accumulated batch; None when nothing was accumulated."""
        if not self.items:
            return None
        batch = to_batch(self.rank, self.entries)
        batch.commits = self.commits
        cut = Cut(batch, self.items)
        self.entries, self.commits = [], []
        self.items = self.nbytes = 0
        self.started = None
        return cut


def to_batch(rank: int, entries: list[Entry]) -> FragmentBatch:
    """Entries as columns; a presence mask only when fragments carry different metrics."""
    batch = FragmentBatch()
    if not entries:
        return batch
    batch.steps = [e.step for e in entries]
    batch.ranks = [rank] * len(entries)
    batch.seqs = [e.seq for e in entries]
    first = entries[0].names
    if all(e.names == first for e in entries):
        batch.metrics = list(first)
        m = len(first)
        for i, e in enumerate(entries):
            batch.values.extend(e.values)
            for j, tail in e.tails.items():
                batch.tails[i * m + j] = tail
        return batch
    index: dict[str, int] = {}
    for e in entries:
        for name in e.names:
            index.setdefault(name, len(index))
    m = len(index)
    values = array("d", bytes(8 * m * len(entries)))
    present = bytearray(m * len(entries))
    for i, e in enumerate(entries):
        for k, (name, x) in enumerate(zip(e.names, e.values, strict=True)):
            j = i * m + index[name]
            values[j] = x
            present[j] = 1
            if k in e.tails:
                batch.tails[j] = e.tails[k]
    batch.metrics = list(index)
    batch.values = values
    batch.present = bytes(present)
    return batch
