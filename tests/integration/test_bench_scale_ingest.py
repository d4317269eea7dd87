"""``bench/scale_ingest.py`` end to end on SQLite: a real ``steptally serve``, client
processes, every step complete, and the figures it prints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "bench" / "scale_ingest.py"
LINE = re.compile(
    r"sqlite cpus=- workers=1 ranks=8: (\d+) rank-steps/s, server CPU (\d+) µs a body "
    r"\(event loops (\d+), other threads (\d+); system (\d+)\), database CPU 0 µs a body, "
    r"reads ([\d.]+) and writes ([\d.]+) a body"
)


def test_scale_ingest_serves_every_step_and_prints_its_figures() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--db", "sqlite", "--ranks", "8", "--steps", "24",
         "--clients", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    match = LINE.fullmatch(done.stdout.strip().splitlines()[-1])
    assert match is not None, done.stdout
    rate, cpu, loops, others, _, reads, writes = map(float, match.groups())
    # /proc counts CPU in ticks of 10 ms: 192 bodies take several
    assert rate > 0 and cpu > 0 and loops + others > 0
    # every body is read from its connection and answered on it, at least
    assert reads >= 1 and writes >= 1
