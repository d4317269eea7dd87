"""``steptally sync`` delivers the spools that ranks closed during an outage left."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
from support.served import ServedService

from steptally.client.reporter import Reporter, ReporterOptions

SPEC = {"metrics": {"a": "sum", "n": "count", "top": "max"}}
STEPS, WORLD, MICRO = 6, 2, 3
FAST = ReporterOptions(flush_interval_s=0.01, backoff_base_s=0.01, backoff_max_s=0.05)


def _value(step: int, rank: int, mb: int) -> float:
    return (0.1 * (step + 1) + rank / 3) * 10.0 ** (mb * 5 - 5)  # sums that round


def _sync(url: str, root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "steptally.service.cli", "sync", url, "--spool-root", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _log_rank(url: str, root: Path, rank: int) -> None:
    reporter = Reporter(url, run="sync", spec=SPEC, rank=rank, world_size=WORLD,
                        spool_dir=root / f"rank-{rank}", options=FAST)  # fmt: skip
    for step in range(STEPS):
        for mb in range(MICRO):
            v = _value(step, rank, mb)
            reporter.log(step, {"a": v, "n": mb + 1, "top": v})
        reporter.commit(step)
    assert not reporter.close(2)  # the service is away: everything stays in the spool


def _step(url: str, step: int) -> dict[str, Any]:
    response = httpx.get(f"{url}/v1/runs/sync/steps/{step}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_two_ranks_closed_during_an_outage_are_delivered_by_sync(tmp_path: Path) -> None:
    root = tmp_path / "spools"
    service = ServedService(f"sqlite:///{tmp_path / 'db.sqlite3'}", tmp_path / "service.log")
    for rank in range(WORLD):
        _log_rank(service.url, root, rank)
    assert len(list(root.rglob("*.json*"))) >= WORLD
    down = _sync(service.url, root)
    assert down.returncode == 1 and "left" in down.stdout
    assert len(list(root.rglob("*.json*"))) >= WORLD  # nothing deleted without an ack
    service.start()
    try:
        done = _sync(service.url, root)
        assert done.returncode == 0, done.stdout + done.stderr
        total = STEPS * WORLD * MICRO
        assert f"delivered {total} fragments (0 duplicates), rejected 0, left 0" in done.stdout
        for step in range(STEPS):
            got = _step(service.url, step)
            values = [_value(step, r, mb) for r in range(WORLD) for mb in range(MICRO)]
            assert got["status"] == "complete"
            assert got["metrics"]["a"]["value"] == math.fsum(values)  # exact, bit for bit
            assert got["metrics"]["n"]["value"] == WORLD * sum(range(1, MICRO + 1))
            assert got["metrics"]["top"]["value"] == max(values)
        assert not [p for p in root.rglob("*") if p.is_file()]  # delivered: all gone
        again = _sync(service.url, root)
        assert again.returncode == 0 and "0 spools" in again.stdout
    finally:
        service.stop()
