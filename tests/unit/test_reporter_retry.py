"""Retry what may pass (connection errors, 5xx, 408, 429), honouring Retry-After with
capped backoff; give up at once on any other 4xx, logged and counted; never double-count."""

from __future__ import annotations

import email.utils
import itertools
import json
import logging
import time
from pathlib import Path

import httpx
import pytest
from support.reporting import FAST, fake_reporter

from steptally.client.algebra import MetricSpec
from steptally.client.reporter import Reporter, ReporterOptions
from steptally.client.reporter.fake import FakeService
from steptally.client.reporter.retry import Backoff, parse_retry_after

SPEC = {"metrics": {"a": "sum", "n": "count"}}


def make(service: FakeService, tmp_path: Path, options: ReporterOptions = FAST) -> Reporter:
    return fake_reporter(service, tmp_path / "spool", SPEC, options)


def fragment_posts(service: FakeService) -> int:
    return len(service.attempt_times())


def log_step(reporter: Reporter, step: int = 0, n: int = 3) -> None:
    for i in range(n):
        reporter.log(step, {"a": float(i), "n": 1})
    reporter.commit(step)


@pytest.mark.parametrize(
    "failure",
    [500, 502, 503, 408, 429, httpx.ConnectError("refused"), httpx.ReadTimeout("slow")],
    ids=str,
)
def test_failures_that_may_pass_are_retried(tmp_path: Path, failure: int | Exception) -> None:
    service = FakeService()
    with make(service, tmp_path) as reporter:
        reporter.log(0, {"a": 1.0})  # registers the run first
        assert reporter.flush(5)
        service.fail_next(failure, failure)
        log_step(reporter, 1)
        assert reporter.flush(5)
        stats = reporter.stats()
    assert stats.retried == 2 and stats.rejected == 0 and stats.sent == 4
    assert service.commits == {(1, 0): 3}


@pytest.mark.parametrize("status", [400, 404, 409, 413, 422])
def test_other_client_errors_are_final_logged_and_counted(
    tmp_path: Path, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    service = FakeService()
    with make(service, tmp_path) as reporter:
        reporter.log(0, {"a": 1.0})
        assert reporter.flush(5)
        service.fail_next(status)
        log_step(reporter, 1)
        assert reporter.flush(5)
        stats = reporter.stats()
        log_step(reporter, 2)  # later batches still go out
        assert reporter.flush(5)
    assert stats.retried == 0 and stats.rejected == 3
    assert stats.last_error is not None
    assert stats.last_error.startswith(f"HTTP {status} http_{status}: scripted {status}; ")
    assert stats.quarantined == 3  # kept on disk, with its error, for `steptally sync`
    (kept,) = (tmp_path / "spool" / "quarantine").glob("*.json*")
    error = kept.with_name(kept.name.split(".")[0] + ".error").read_text()
    assert error == f"HTTP {status} http_{status}: scripted {status}"
    assert f"HTTP {status} http_{status}: scripted {status}" in caplog.text
    assert (1, 0) not in service.commits and service.commits[2, 0] == 3
    assert fragment_posts(service) == 3  # never tried again


def test_retry_after_delays_the_next_attempt(tmp_path: Path) -> None:
    service = FakeService()
    with make(service, tmp_path) as reporter:
        reporter.log(0, {"a": 1.0})
        assert reporter.flush(5)
        service.fail_next(httpx.Response(503, headers={"retry-after": "1"}))
        log_step(reporter, 1)
        assert reporter.flush(10)
    times = service.attempt_times()
    assert len(times) == 3 and reporter.stats().retried == 1
    assert 0.95 <= times[2] - times[1] < 3.0  # backoff alone would wait at most 0.05 s
    assert service.commits == {(1, 0): 3}


def test_retry_after_http_date_and_garbage() -> None:
    now = 1_700_000_000.0
    date = email.utils.formatdate(now + 7, usegmt=True)
    assert parse_retry_after(date, now=lambda: now) == pytest.approx(7.0)
    assert parse_retry_after("2.5") == 2.5
    assert parse_retry_after("-3") == 0.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None


def test_backoff_grows_exponentially_with_jitter_and_is_capped() -> None:
    high = Backoff(0.1, 1.0, rng=lambda: 1.0)
    assert [high.next() for _ in range(7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1, 1, 1])
    low = Backoff(0.1, 1.0, rng=lambda: 0.0)
    assert [low.next() for _ in range(5)] == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.5])
    assert max(Backoff(0.5, 30.0).next() for _ in range(200)) <= 30.0
    capped = Backoff(0.1, 1.0)
    assert capped.next(retry_after=1e6, max_retry_after=300.0) == 300.0
    high.reset()
    assert high.next() == pytest.approx(0.1)


def test_backoff_in_the_reporter_is_capped(tmp_path: Path) -> None:
    times: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        times.append(time.monotonic())
        raise httpx.ConnectError("refused")

    options = ReporterOptions(flush_interval_s=0.01, backoff_base_s=0.01, backoff_max_s=0.04)
    with Reporter(
        "http://steptally.test",
        run="r",
        spec=SPEC,
        rank=0,
        world_size=1,
        transport=httpx.MockTransport(handler),
        spool_dir=tmp_path,
        options=options,
    ) as reporter:
        reporter.log(0, {"a": 1.0})
        assert not reporter.flush(1.0)
        reporter.close(0)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(gaps) >= 10  # uncapped doubling from 0.01 s would manage about 6 in 1 s
    assert max(gaps[3:]) < 0.2


def test_spec_conflict_fails_delivery_without_raising(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    service = FakeService()
    service.specs["r"] = MetricSpec.build({"a": "max"})
    caplog.set_level(logging.ERROR, logger="steptally.reporter")
    with make(service, tmp_path) as reporter:
        for step in range(3):
            log_step(reporter, step)
        assert reporter.flush(5)
        stats = reporter.stats()
    assert stats.failed and stats.sent == 0 and stats.rejected == 0 and stats.spooled == 9
    assert "spec_conflict" in (stats.last_error or "")
    assert "`steptally sync`" in (stats.last_error or "")
    assert "could not be registered" in caplog.text and "'a' is registered as max" in caplog.text
    assert service.fragments == {}
    kept = list((tmp_path / "spool").glob("*.json*"))  # left for `steptally sync`
    assert sum(int(p.name.split("-")[2][:-1]) for p in kept) == 9
    assert json.loads((tmp_path / "spool" / "registration").read_text())["name"] == "r"


def test_a_forgotten_run_is_registered_again(tmp_path: Path) -> None:
    service = FakeService()
    with make(service, tmp_path) as reporter:
        log_step(reporter, 0)
        assert reporter.flush(5)
        service.specs.clear()  # e.g. the service was reset
        log_step(reporter, 1)
        assert reporter.flush(5)
    assert [r.path for r in service.received].count("/v1/runs") == 2
    assert service.commits == {(0, 0): 3, (1, 0): 3}


def test_a_retry_after_a_lost_answer_is_counted_once(tmp_path: Path) -> None:
    service = FakeService()
    inner = service.handle
    lost = {"left": 1}

    def lose_answer(request: httpx.Request) -> httpx.Response:
        response = inner(request)  # the service stored the batch ...
        if request.url.path.endswith("/fragments") and lost["left"]:
            lost["left"] -= 1
            raise httpx.ReadTimeout("answer lost")  # ... but the answer never came back
        return response

    service.handle = lose_answer  # type: ignore[method-assign]
    with make(service, tmp_path) as reporter:
        log_step(reporter, 0)
        assert reporter.flush(5)
    first, second = service.batches()
    assert list(first.rows()) == list(second.rows())  # same keys, same values
    assert service.duplicates == 3 and len(service.fragments) == 3
