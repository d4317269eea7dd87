"""How far a step is: which ranks committed how many fragments, and what arrived.

Nothing here takes time or memory per rank that has not reported: the missing ranks
are counted from the committed ones, and listed only up to ``MAX_LISTED_RANKS``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

MAX_LISTED_RANKS = 1000  # a step's ranks_missing lists at most these; ranks_missing_count all


class StepStatus(StrEnum):
    OPEN = "open"
    COMPLETE = "complete"
    PARTIAL = "partial"


@dataclass(frozen=True, slots=True)
class Progress:
    """``commits`` maps a rank to its declared fragment count, ``received`` to what arrived."""

    world_size: int
    commits: Mapping[int, int]
    received: Mapping[int, int]

    def ranks_committed(self) -> list[int]:
        return sorted(self.commits)

    def ranks_missing(self, limit: int = MAX_LISTED_RANKS) -> list[int]:
        """The lowest ``limit`` ranks that have not committed, in order."""
        out: list[int] = []
        rank = 0
        while len(out) < limit and rank < self.world_size:  # at most limit + committed turns
            if rank not in self.commits:
                out.append(rank)
            rank += 1
        return out

    def ranks_missing_count(self) -> int:
        return self.world_size - sum(1 for r in self.commits if 0 <= r < self.world_size)

    def missing_fragments(self) -> dict[int, int]:
        """Committed ranks whose declared fragments have not all arrived, with the shortfall."""
        out = {}
        for rank in sorted(self.commits):
            short = self.commits[rank] - self.received.get(rank, 0)
            if short > 0:
                out[rank] = short
        return out

    def received_total(self) -> int:
        return sum(self.received.values())

    def expected(self) -> int | None:
        """Fragments the step will have, known once every rank has committed."""
        if len(self.commits) < self.world_size:
            return None
        return sum(self.commits.values())

    def is_complete(self) -> bool:
        return len(self.commits) == self.world_size and not self.missing_fragments()


def is_complete(world_size: int, committed_ranks: int, received: int, expected: int) -> bool:
    """Completeness from a step's counters alone.

    Sound because every stored fragment of a committed rank has ``seq`` below the
    count it declared, and keys are unique: once all ranks committed, ``received``
    reaches ``expected`` exactly when every declared fragment is there.
    """
    return committed_ranks == world_size and received == expected
