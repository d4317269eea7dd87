"""The reporter against a real ``steptally serve`` under poisoned and failing conditions.

One bad item never costs the rest of its batch; a spool is never deleted unless
delivered; nothing is lost without being counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.served import ServedService

from steptally.client.reporter import Reporter, ReporterOptions

SPEC = {"metrics": {"a": "sum", "n": "count"}}
Serve = Callable[..., ServedService]


def _sqlite(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'steptally.sqlite3'}"


def _register(url: str, world_size: int = 1, **extra: Any) -> None:
    body = {"name": "r", "world_size": world_size, **SPEC, "step_timeout_s": 300.0, **extra}
    response = httpx.post(f"{url}/v1/runs", json=body)
    assert response.status_code in (200, 201), response.text


def _step(url: str, step: int) -> dict[str, Any]:
    response = httpx.get(f"{url}/v1/runs/r/steps/{step}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_one_conflicting_fragment_among_six_steps_leaves_five_landed(
    serve: Serve, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    service = serve(_sqlite(tmp_path))
    _register(service.url)
    other = {"fragments": [{"step": 2, "rank": 0, "seq": 0, "values": {"a": 99.0, "n": 1}}]}
    assert httpx.post(f"{service.url}/v1/runs/r/fragments", json=other).status_code == 200
    reporter = Reporter(
        service.url,
        run="r",
        spec=SPEC,
        rank=0,
        world_size=1,
        spool_dir=tmp_path / "spool",
        options=ReporterOptions(flush_interval_s=5.0),
    )
    with caplog.at_level(logging.ERROR, logger="steptally.reporter"):
        for step in range(6):
            reporter.log(step, {"a": step + 0.5, "n": 1})
            reporter.commit(step)
        assert reporter.flush(30)
        stats = reporter.stats()
        assert reporter.close(5)
    assert (stats.sent, stats.rejected, stats.dropped, stats.queued) == (5, 1, 0, 0)
    assert "step 2 rank 0 fragment seq 0: fragment_conflict" in (stats.last_error or "")
    lines = [r.getMessage() for r in caplog.records if "fragment_conflict" in r.getMessage()]
    assert len(lines) == 1 and "step 2 rank 0" in lines[0]
    for step in range(6):
        got = _step(service.url, step)
        assert got["status"] == "complete"
        assert got["metrics"]["a"]["value"] == (99.0 if step == 2 else step + 0.5)
    assert not list((tmp_path / "spool").glob("*.json*"))
