"""``bench/event_cost.py`` runs what it times: events of a finalised step published to
the hub and sent whole by every stream following the run (the script waits for each
stream to have sent every event, and fails otherwise)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "bench" / "event_cost.py"


def test_every_stream_sends_every_event_of_a_step_of_32_metrics() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--n", "20", "--subscribers", "2", "--ranks", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    found = re.search(r"\(2 stream\(s\), ([\d,]+) bytes an event\)", done.stdout)
    assert found is not None, done.stdout
    # an event: its id, its name and the step object with 32 metrics and the derived one
    assert int(found.group(1).replace(",", "")) > 33 * 60
