"""``bench/scale_paired.py``: Steptally (a real ``steptally serve`` on SQLite) and the
real VictoriaMetrics in turns; the slices' order, their steps, and the figures made
from them."""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "bench" / "scale_paired.py"
sys.path.insert(0, str(SCRIPT.parent))
from scale_paired import COLUMNS, Slice, totals  # noqa: E402


def _slice(round: int, side: str, done: int, elapsed_s: float) -> Slice:
    return Slice(round, side, 0, 1, done, 0.0, elapsed_s, 0.5, 0.25)


def test_the_figures_leave_the_warm_up_out_and_weigh_each_slice_by_its_time() -> None:
    slices = [
        _slice(0, "victoria", 100, 10.0),  # warm-up: would halve the ratio
        _slice(0, "steptally", 100, 20.0),
        _slice(1, "steptally", 300, 1.0),
        _slice(1, "victoria", 200, 1.0),
        _slice(2, "victoria", 100, 1.0),
        _slice(2, "steptally", 300, 3.0),
    ]
    t = totals(slices)
    assert t["steptally_rate"] == 600 / 4.0
    assert t["victoria_rate"] == 300 / 2.0
    assert t["ratio"] == 1.0
    assert t["round_ratios"] == [1.5, 1.0]
    assert t["median_round_ratio"] == 1.25
    assert t["rounds_at_1"] == 2
    assert t["steptally_cpu_us_per_value"] == pytest.approx(1e6 * 1.0 / (600 * 256))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("victoria-metrics") is None, reason="needs victoria-metrics")
def test_a_quick_run_alternates_the_two_abba_over_every_step(tmp_path: Path) -> None:
    out = tmp_path / "paired.1"  # a dot in the name: paired.1.csv, not paired.csv
    args = ["--db", "sqlite", "--ranks", "8", "--rounds", "2", "--slice-steps", "2"]
    args += ["--client-cpus", "0"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    with open(tmp_path / "paired.1.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)
    assert {(r["db"], r["ranks"], r["cpus"], r["client_cpus"]) for r in rows} == {
        ("sqlite", "8", "-", "0")
    }
    order = [(int(r["round"]), r["side"]) for r in rows]
    assert order == [
        (0, "victoria"), (0, "steptally"),
        (1, "steptally"), (1, "victoria"),
        (2, "victoria"), (2, "steptally"),
    ]  # fmt: skip
    for side in ("steptally", "victoria"):
        mine = [r for r in rows if r["side"] == side]
        assert [int(r["first_step"]) for r in mine] == [0, 2, 4]  # every step, once each
        assert all(int(r["rank_steps"]) == 8 * 2 for r in mine)
    starts = [float(r["started_s"]) for r in rows]
    assert starts == sorted(starts)
    rate = {
        side: sum(int(r["rank_steps"]) for r in rows if r["side"] == side and r["round"] != "0")
        / sum(float(r["elapsed_s"]) for r in rows if r["side"] == side and r["round"] != "0")
        for side in ("steptally", "victoria")
    }
    text = (tmp_path / "paired.1.md").read_text()
    assert f"**{rate['steptally'] / rate['victoria']:.2f}** over all slices" in text
    assert (tmp_path / "paired.1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert done.stderr.count("(warm-up)") == 2
    # the run summarised: its line, and the median of one run
    summary = tmp_path / "summary"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--summarise", str(tmp_path / "paired.1.csv"),
         "--out", str(summary)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "summary.md").read_text().splitlines()
    ratio = f"{rate['steptally'] / rate['victoria']:.2f}"
    assert lines[2].startswith(f"| sqlite | 8 | - | 0 | paired.1.csv | {ratio} |")
    assert lines[3].startswith(f"| **sqlite | 8 | - | 0** | **median of 1** | **{ratio}** (")
    assert (tmp_path / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
