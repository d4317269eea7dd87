"""``bench/group_cost.py`` end to end on SQLite: groups of the sizes asked for, stored
through the writer's path, each size's row in the CSV; and its line fit. And
``bench/store_floor.py``, the floor under it: every group's rows stored, on both stores."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "bench" / "group_cost.py"
sys.path.insert(0, str(SCRIPT.parent))
from group_cost import fit, per_step  # noqa: E402


def test_the_fit_is_a_fixed_cost_and_a_cost_per_body() -> None:
    assert fit([1, 2, 4], [3.0, 5.0, 9.0]) == pytest.approx((1.0, 2.0))
    assert fit([8], [4.0]) == (4.0, 0.0)


def test_a_step_holds_the_sizes_in_turn() -> None:
    assert per_step(8, [2, 4]) == {2: 2, 4: 1}  # 2, 4, 2
    # 4 turns of 63 bodies, then 1 and 2, and 1 body left: a group of 4 short of 3
    assert per_step(256, [1, 2, 4, 8, 16, 32]) == {1: 5, 2: 5, 4: 4, 8: 4, 16: 4, 32: 4}
    with pytest.raises(SystemExit):
        per_step(8, [16])


def test_group_cost_stores_groups_of_each_size(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--db", "sqlite", "--ranks", "8", "--sizes", "2", "4",
         "--groups", "6", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    with open(tmp_path / "group_cost_sqlite_8.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["size"]) for r in rows] == [2, 4]
    # 8 ranks a step: groups of 2 and 4 take turns (2, 4, 2), from the third step on
    assert all(int(r["groups"]) >= 6 for r in rows)
    assert all(float(r["writer_ms"]) > 0 and float(r["wall_ms"]) > 0 for r in rows)
    assert all(float(r["db_ms"]) == 0.0 for r in rows)  # SQLite works in the writer's thread
    assert (tmp_path / "group_cost_sqlite_8.png").stat().st_size > 0
    assert "writer_ms:" in done.stdout


@pytest.mark.parametrize("db", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_store_floor_stores_every_groups_rows(db: str) -> None:
    script = SCRIPT.parent / "store_floor.py"
    done = subprocess.run(
        [sys.executable, str(script), "--db", db, "--steps", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    table = [
        line.split("|")[1:-1] for line in lines if line.startswith("| ") and "bodies" not in line
    ]
    assert [(int(r[0]), r[1].strip()) for r in table] == [
        (1, "no"),
        (1, "yes"),
        (8, "no"),
        (8, "yes"),
    ]
    assert all(float(r[2]) > 0 and float(r[4]) > 0 for r in table)
    # the database's own CPU: PostgreSQL's backend; SQLite works in this thread
    assert all((float(r[3]) > 0) == (db == "postgres") for r in table)
    # 4 cases × 2 steps × 256 ranks, one row of each table a body
    assert lines[-1] == "rows: fragments 2048, commits 2048, partials 2048"
