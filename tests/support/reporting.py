"""A reporter of rank 0 of 1 talking to an in-memory :class:`FakeService`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from steptally.client.reporter import Reporter, ReporterOptions
from steptally.client.reporter.fake import FakeService

# short intervals, so that tests of time and retries take milliseconds
FAST = ReporterOptions(flush_interval_s=0.01, backoff_base_s=0.01, backoff_max_s=0.05)


def fake_reporter(
    service: FakeService,
    spool: Path,
    spec: Mapping[str, Any],
    options: ReporterOptions = FAST,
    **kwargs: Any,
) -> Reporter:
    return Reporter(
        "http://steptally.test",
        run="r",
        spec=spec,
        rank=0,
        world_size=1,
        transport=service.transport(),
        spool_dir=spool,
        options=options,
        **kwargs,
    )
