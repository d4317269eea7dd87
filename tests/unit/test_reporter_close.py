"""``close()``: a bounded wait, and an answer saying what happened."""

from __future__ import annotations

import time
from pathlib import Path

from support.reporting import FAST, fake_reporter

from steptally.client.reporter import Closed
from steptally.client.reporter.fake import FakeService
from steptally.client.reporter.options import ReporterOptions

SPEC = {"metrics": {"a": "sum"}}


def test_close_after_delivery_is_true_and_counts_what_was_sent(tmp_path: Path) -> None:
    service = FakeService()
    reporter = fake_reporter(service, tmp_path / "spool", SPEC)
    for step in range(5):
        reporter.log(step, {"a": 1.0})
        reporter.commit(step)
    closed = reporter.close()
    assert isinstance(closed, Closed) and closed
    assert (closed.delivered, closed.left, closed.stats.sent) == (True, 0, 5)
    assert closed.spool_dir == tmp_path / "spool"
    assert reporter.close() is closed  # a second close answers the same
    assert len(service.fragments) == 5


def test_close_while_down_returns_within_its_bound_and_names_what_is_left(
    tmp_path: Path,
) -> None:
    service = FakeService()
    service.down = True
    slow = ReporterOptions(flush_interval_s=0.01, backoff_base_s=5.0, backoff_max_s=5.0)
    reporter = fake_reporter(service, tmp_path / "spool", SPEC, slow)
    for step in range(7):
        reporter.log(step, {"a": 1.0})
        reporter.commit(step)
    t0 = time.monotonic()
    closed = reporter.close(timeout=0.5)
    took = time.monotonic() - t0
    assert took < 0.5 + 0.25 + 0.1  # the timeout and the documented grace
    assert not closed and closed.left == 7
    assert (closed.stats.sent, closed.stats.dropped, closed.stats.spooled) == (0, 0, 7)
    assert sum(int(p.name.split("-")[2][:-1]) for p in (tmp_path / "spool").glob("*.json*")) == 7


def test_the_default_timeout_is_exit_timeout_s() -> None:
    assert FAST.exit_timeout_s == ReporterOptions().exit_timeout_s == 10.0
