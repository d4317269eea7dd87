"""The instructions a step's finalisation costs the service, counted by callgrind.

What a finalisation does in Python once its step's partial rows are read: merge the
``--ranks`` ranks' partial states (one a rank: a reporter's body of 8 microbatches ×
``bench/ingest.py``'s 32 metrics and its derived value), report every metric and the
derived value rounded once, and make the step's result JSON and its stored values
(``steptally.service.domain.step.finalise`` over ``partial.merged``). No database, no
HTTP: the part of a step's cost that every store pays, and which at 8 ranks 8 bodies
share (bench/README.md, Scale).

Run under ``valgrind --tool=callgrind`` with ``n`` and ``2n`` finalisations; the
difference over ``n`` is what one costs once warm. ``--before REV`` counts that
revision first (built as ``scale_rounds.py`` builds it). ``--inner`` runs once without
valgrind and prints the time a finalisation (median of 5 rounds).

Usage:
    python bench/finalise_instructions.py --before HEAD~3
    python bench/finalise_instructions.py --ranks 256 --n 20
    python bench/finalise_instructions.py --inner --n 2000
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ingest import spec
from ingest_instructions import callgrind, each_version
from partial_state import ROWS, WIDTH, body


def step_parts(ranks: int) -> tuple[Any, list[bytes]]:
    """A run of ``bench/ingest.py``'s 32 metrics and its derived value, and ``ranks``
    ranks' partial states of one of its steps (a reporter's body each)."""
    from steptally.client.algebra import MetricSpec
    from steptally.service.domain import partial
    from steptally.service.domain.run import RunRecord

    names = tuple(spec(WIDTH)["metrics"])
    metrics = MetricSpec.from_json(spec(WIDTH))
    run = RunRecord(1, "bench", ranks, metrics, 60.0, 0.0, names, ("mean0",))
    rnd = random.Random(7)
    return run, [partial.state_of(run, body(rnd)) for _ in range(ranks)]


def finalise_step(run: Any, states: Sequence[bytes]) -> tuple[Any, Any]:
    """The step of ``states`` (every rank's, every fragment of each) finalised complete:
    its row (its values to store included) and its result."""
    from steptally.service.domain import partial
    from steptally.service.domain import step as rules
    from steptally.service.domain.progress import Progress, StepStatus
    from steptally.service.domain.step import StepState

    ranks = len(states)
    every = {r: ROWS for r in range(ranks)}
    fragments = ROWS * ranks
    row = StepState(1, StepStatus.OPEN, 0, ranks, fragments, fragments, 0, 0.0, 60.0, None, None)
    progress = Progress(ranks, every, every)
    merged = partial.merged(run, states)
    return row, rules.finalise(run, row, progress, merged, StepStatus.COMPLETE, 1.0)


def inner(ranks: int, n: int, timed: bool) -> None:
    run, states = step_parts(ranks)

    def finalise() -> None:
        row, _ = finalise_step(run, states)
        assert len(row.values) == WIDTH + 1

    finalise()
    if not timed:
        for _ in range(n):
            finalise()
        return
    took = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            finalise()
        took.append((time.perf_counter() - t0) / n * 1e6)
    print(f"{statistics.median(took):.1f} µs a finalisation of {ranks} ranks (median of 5)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--n", type=int, default=200, help="the runs finalise n and 2n steps")
    p.add_argument("--before", help="a revision to count first, built as scale_rounds.py does")
    p.add_argument("--inner", action="store_true", help="one timed run, in this process")
    p.add_argument("--count", action="store_true", help=argparse.SUPPRESS)  # under callgrind
    args = p.parse_args()
    if args.inner or args.count:
        inner(args.ranks, args.n, timed=not args.count)
        return

    def count(name: str, path: Path | None) -> None:
        runs = [
            callgrind(Path(__file__), ["--count", "--ranks", str(args.ranks), "--n", str(k)], path)
            for k in (args.n, 2 * args.n)
        ]
        print(f"{name}: {(runs[1] - runs[0]) / args.n:,.0f} instructions a finalisation "
              f"of {args.ranks} ranks", flush=True)  # fmt: skip

    each_version(args.before, count)


if __name__ == "__main__":
    main()
