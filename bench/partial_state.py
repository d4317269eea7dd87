"""The exact partial state of one body, three ways: Python, numpy, and the C kernel.

A reporter's body (8 microbatch fragments × 32 metrics: 28 sums, 2 counts, a min and a
max) is combined into the exact partial state the store keeps for its (step, rank):

* **python**: ``partial.encode(partial.of_cells(...))``, the pure-Python path (the
  fallback where the kernel is not built);
* **numpy**: the sums vectorised — each value's 53-bit integer mantissa and exponent
  (``np.frexp``), the mantissas of equal (column, exponent) summed in int64 (exact: 8
  values of < 2**53 each), then one Python integer per column from those few groups —
  with the counts and extremes as numpy reductions;
* **c**: ``partial.state_of``, the compiled kernel (``service/domain/_partial.c``).

Each is checked against the others (the exact sums bit for bit) before it is timed.

    python bench/partial_state.py            # 20,000 bodies each, interleaved
"""

from __future__ import annotations

import argparse
import random
import statistics
import struct
import sys
import time
from pathlib import Path

import numpy as np

from steptally.client.algebra import MetricSpec
from steptally.client.algebra.exact import SCALE_BITS
from steptally.service.domain import partial
from steptally.service.domain.run import RunRecord

sys.path.insert(0, str(Path(__file__).parent))
from ingest import spec  # the bench's 32 metrics: 28 sums, 2 counts, a min, a max

ROWS, WIDTH = 8, 32


def body(rnd: random.Random) -> list[tuple[bytes, None, None]]:
    cells = []
    for _ in range(ROWS):
        row = [rnd.gauss(0, 1) * 2.0 ** rnd.randint(-30, 30) for _ in range(WIDTH)]
        row[28], row[29] = float(rnd.randrange(1, 4096)), float(rnd.randrange(1, 64))
        cells.append((struct.pack(f"<{WIDTH}d", *row), None, None))
    return cells


def numpy_sums(cells: list[tuple[bytes, None, None]], sums: int) -> list[int]:
    """The exact sums (in units of 2**-1074) of the first ``sums`` columns: finite
    values only, as the bench's are."""
    table = np.frombuffer(b"".join(v for v, _, _ in cells), dtype="<f8").reshape(-1, WIDTH)
    values = table[:, :sums].ravel()
    mant, exp = np.frexp(values)  # value = mant * 2**exp, 0.5 <= |mant| < 1
    ints = (mant * 2.0**53).astype(np.int64)  # exact: 53 bits
    exps = exp.astype(np.int64) - 53 + SCALE_BITS  # value * 2**1074 = ints << exps
    cols = np.tile(np.arange(sums), len(cells))
    order = np.lexsort((exps, cols))
    keys = cols[order] * 4096 + exps[order]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    grouped = np.add.reduceat(ints[order], starts)
    out = [0] * sums
    for key, total in zip(keys[starts].tolist(), grouped.tolist(), strict=True):
        col, shift = divmod(key, 4096)
        out[col] += total << shift
    return out


def numpy_state(cells: list[tuple[bytes, None, None]]) -> tuple[list[int], np.ndarray]:
    table = np.frombuffer(b"".join(v for v, _, _ in cells), dtype="<f8").reshape(-1, WIDTH)
    extremes = np.array([table[:, 28:30].sum(0).sum(), table[:, 30].min(), table[:, 31].max()])
    return numpy_sums(cells, 28), extremes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--bodies", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if partial.kernel is None:
        raise SystemExit("the compiled kernel is not built (pip install -e . with a compiler)")
    names = spec(WIDTH)["metrics"]
    run = RunRecord(1, "b", 8, MetricSpec.from_json(spec(WIDTH)), 60.0, 0.0, tuple(names))
    rnd = random.Random(7)
    bodies = [body(rnd) for _ in range(200)]
    for cells in bodies:  # the three agree before anything is timed
        state = partial.state_of(run, cells)
        assert state == partial.encode(run, partial.of_cells(run, cells))
        acc = partial.decode(run, state)
        want = [acc.states[f"m{j:02d}"].acc for j in range(28)]  # type: ignore[union-attr]
        assert numpy_sums(cells, 28) == want
    ways = {
        "python": lambda c: partial.encode(run, partial.of_cells(run, c)),
        "numpy": numpy_state,
        "c": lambda c: partial.state_of(run, c),
    }
    took: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            n = args.bodies // args.rounds
            t0 = time.perf_counter()
            for i in range(n):
                way(bodies[i % len(bodies)])
            took[name].append((time.perf_counter() - t0) / n * 1e6)
    for name, values in took.items():
        print(f"{name:>6}: {statistics.median(values):7.1f} µs a body (median of {args.rounds})")


if __name__ == "__main__":
    main()
