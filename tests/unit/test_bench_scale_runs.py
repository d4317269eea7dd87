"""``bench/scale_runs.py``: a row during which the whole machine slowed (its clients, who
do the same work in every run, took over 1.5× the median CPU a request) is marked, that
row only, and the runs' table says how many of a configuration's runs were."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import scale_runs


def _row(run: int, config: str, client_us: float, ratio: float) -> dict[str, Any]:
    return {
        "run": run,
        "config": config,
        "ranks": "256",
        "rank_steps_per_s": "4000",
        "victoria_stored_rank_steps_per_s": "4000",
        "victoria_rank_steps_per_s": "3000",
        "victoria_stored_ratio": str(ratio),
        "victoria_ratio": "1.3",
        "floor_ratio": "0.8",
        "client_cpu_us_per_request": str(client_us),
    }


def test_only_the_rows_whose_clients_slowed_are_marked() -> None:
    rows = [
        _row(1, "sqlite", 40, 1.1),
        _row(1, "postgres", 44, 1.2),
        _row(2, "sqlite", 38, 1.0),
        _row(2, "postgres", 105, 0.6),  # this row's machine slowed; run 2's SQLite did not
        _row(3, "sqlite", 60, 1.3),  # under 1.5× the median (43): not marked
        _row(3, "postgres", 42, 0.9),
    ]
    assert scale_runs.slowed(rows) == {(2, "postgres", 256)}
    lines = scale_runs.table(rows).splitlines()
    marked = [line for line in lines if "(slowed)" in line]
    assert marked == [
        "| postgres | 256 | 2 | 4,000 | 4,000 (3,000) | 0.60 (1.30) | 0.80 | 105 (slowed) |"
    ]
    assert "| 1 slowed |" in next(line for line in lines if line.startswith("| **postgres"))
    assert "| 0 slowed |" in next(line for line in lines if line.startswith("| **sqlite"))
