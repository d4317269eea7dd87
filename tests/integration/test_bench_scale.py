"""``bench/scale.py --quick`` end to end: real ``steptally serve`` on SQLite, the real
Pushgateway and VictoriaMetrics, client processes; the CSV has every column and
plausible values."""

from __future__ import annotations

import csv
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "bench" / "scale.py"
sys.path.insert(0, str(SCRIPT.parent))
from scale import COLUMNS, VALUES_PER_BODY  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("prometheus-pushgateway") is None, reason="needs prometheus-pushgateway"
    ),
    pytest.mark.skipif(shutil.which("victoria-metrics") is None, reason="needs victoria-metrics"),
]

POSITIVE = [
    "elapsed_s",
    "rank_steps_per_s",
    "values_per_s",
    "us_per_value",
    "floor_requests_per_s",
    "floor_ratio",
    "pushgateway_rank_steps_per_s",
    "pushgateway_ratio",
    "victoria_rank_steps_per_s",
    "victoria_ratio",
    "victoria_floor_ratio",
    "victoria_cpu_us_per_value",
    "victoria_busy_share",
    "victoria_stored_rank_steps_per_s",
    "victoria_stored_ratio",
    "victoria_stored_cpu_us_per_value",
    "completing_rtt_p50_ms",
    "completing_rtt_p99_ms",
    "rtt_p50_ms",
    "server_cpu_s",
    "client_cpu_s",
    "server_cpu_us_per_value",
    "loop_cpu_us_per_request",
    "loop_busy_share",
    "client_cpu_us_per_request",
    "floor_client_cpu_us_per_request",
    "peak_rss_mb",
]


def test_quick_writes_a_csv_and_a_plot(tmp_path: Path) -> None:
    turns = ["--turns", "1", "--turn-bodies", "32", "--client-cpus", "0"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", *turns, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    with open(tmp_path / "scale_quick.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)
    assert [(r["config"], int(r["ranks"])) for r in rows] == [("sqlite", 8), ("sqlite", 64)]
    for row in rows:
        ranks, steps = int(row["ranks"]), int(row["steps"])
        assert int(row["rank_steps"]) == ranks * steps
        assert int(row["values"]) == ranks * steps * VALUES_PER_BODY
        for name in POSITIVE:
            value = float(row[name])
            assert math.isfinite(value) and value > 0, (name, row[name])
        for name in ("finalise_p50_ms", "finalise_p99_ms"):
            assert math.isfinite(float(row[name])), (name, row[name])
        assert float(row["finalise_p50_ms"]) <= float(row["finalise_p99_ms"])
        assert float(row["values_per_s"]) == pytest.approx(
            float(row["rank_steps_per_s"]) * VALUES_PER_BODY, rel=1e-4
        )
        for key in ("victoria", "victoria_stored"):
            assert float(row[f"{key}_ratio"]) == pytest.approx(
                float(row["rank_steps_per_s"]) / float(row[f"{key}_rank_steps_per_s"]), rel=1e-4
            )
        assert float(row["db_cpu_s"]) == 0.0  # SQLite runs inside the server
        loop_s = float(row["loop_cpu_us_per_request"]) * int(row["rank_steps"]) / 1e6
        assert loop_s <= float(row["server_cpu_s"]) + 0.02  # a thread of the server
        assert float(row["loop_busy_share"]) <= 1.05
    # each row again in turns with VictoriaMetrics: slices of 32 rank-steps, whole steps
    assert [int(r["turns_slice_steps"]) for r in rows] == [4, 1]
    for row in rows:
        assert row["client_cpus"] == "0" and int(row["turns_rounds"]) == 1
        assert int(row["turns_rounds_at_1"]) == (float(row["turns_ratio"]) >= 1.0)
        assert float(row["turns_ratio"]) == pytest.approx(
            float(row["turns_rank_steps_per_s"]) / float(row["turns_victoria_rank_steps_per_s"]),
            rel=1e-4,
        )
        for name in ("turns_cpu_us_per_value", "turns_victoria_cpu_us_per_value"):
            # a slice this short can pass within one of the kernel's 10 ms CPU ticks
            assert math.isfinite(float(row[name])) and float(row[name]) >= 0, (name, row[name])
    table = done.stdout[done.stdout.index("In turns with VictoriaMetrics") :]
    assert f"| sqlite | 64 | 1 × 1 | {float(rows[1]['turns_rank_steps_per_s']):.0f} |" in table
    assert done.stderr.count(" ranks in turns: ") == 2
    assert done.stderr.count("(warm-up)") == 4  # a warm-up round of two slices a row
    assert (tmp_path / "scale_quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # one line of progress per row, and one per Pushgateway anchor
    assert done.stderr.count(" ranks × ") == 2
    assert done.stderr.count("Pushgateway ") >= 2
    assert done.stderr.count("VictoriaMetrics ") >= 4
    assert done.stderr.count("(stored series;") == 2  # beside each row, with its series stored
