"""``bench/finalise_instructions.py`` runs what it counts: a step's finalisation from its
ranks' partial states, every value of the 32 metrics and the derived one stored (the
script checks that itself, and fails otherwise)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "bench" / "finalise_instructions.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done


def test_the_counted_finalisations_run_and_store_every_value() -> None:
    run("--count", "--ranks", "3", "--n", "2")
    timed = run("--inner", "--ranks", "2", "--n", "1")
    assert "µs a finalisation of 2 ranks" in timed.stdout
