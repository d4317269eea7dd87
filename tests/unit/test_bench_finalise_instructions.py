"""``bench/finalise_instructions.py`` runs what it counts: a step's finalisation from its
ranks' partial states, every value of the 32 metrics and the derived one stored (the
script checks that itself, and fails otherwise)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "bench" / "finalise_instructions.py"


def test_the_counted_finalisations_run_and_store_every_value() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--count", "--ranks", "3", "--n", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    timed = subprocess.run(
        [sys.executable, str(SCRIPT), "--inner", "--ranks", "2", "--n", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert timed.returncode == 0, timed.stderr
    assert "µs a finalisation of 2 ranks" in timed.stdout
