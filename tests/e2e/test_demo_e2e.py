"""The demo against a real service: every step ends complete, the late rank's step
went through partial first, and the values are the loss's real diagnostics."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")

from steptally.client.demo import DemoPlan, run_demo

pytestmark = pytest.mark.slow


def test_demo_run_ends_complete_with_one_late_rank(
    tmp_path: Path, serve: Callable[..., Any]
) -> None:
    service = serve(f"sqlite:///{tmp_path / 'demo.sqlite3'}")
    plan = DemoPlan(ranks=3, steps=4, step_interval_s=0.05, step_timeout_s=0.5, late_every=3)
    lines: list[str] = []
    run_demo(service.url, plan, lines.append)
    steps = httpx.get(f"{service.url}/v1/runs/{plan.run}/steps").json()["steps"]
    assert [s["status"] for s in steps] == ["complete"] * 4
    revisions = [s["revision"] for s in steps]
    # step 2 was finalised partial first, then again when the late rank's report arrived
    # (once more if its fragments and its commit travelled in separate batches)
    assert revisions[:2] == [1, 1] and revisions[2] >= 2 and revisions[3] == 1
    assert any("partial" in line and "missing [2]" in line for line in lines)
    ratio = steps[0]["metrics"]["probs_ratio"]["value"]
    assert math.isfinite(ratio) and 0.9 < ratio < 1.1
    assert steps[0]["metrics"]["filtered_curr_tokens"]["value"] > 0
