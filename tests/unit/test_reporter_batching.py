"""Batches are cut by count, bytes and time, sent in the compact form, gzipped when large,
and every commit travels with or after the fragments it counts."""

from __future__ import annotations

import gzip
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support.reporting import fake_reporter

from steptally.client.reporter import Reporter, ReporterOptions
from steptally.client.reporter.fake import FakeService

SPEC = {"metrics": {f"m{i}": "sum" for i in range(4)}}
ROW = {f"m{i}": float(i) for i in range(4)}
SLOW = 30.0  # a flush interval that never fires within a test


def make(service: FakeService, tmp_path: Path, **options: float) -> Reporter:
    return fake_reporter(service, tmp_path / "spool", SPEC, ReporterOptions(**options))  # type: ignore[arg-type]


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def test_batches_are_cut_by_count(tmp_path: Path) -> None:
    service = FakeService()
    with make(service, tmp_path, max_batch_fragments=10, flush_interval_s=SLOW) as reporter:
        for _ in range(25):
            reporter.log(0, ROW)
        assert wait_until(lambda: len(service.batches()) == 2)
        time.sleep(0.1)
        assert [len(b) for b in service.batches()] == [10, 10]  # the 5 left wait for more
        assert reporter.flush(5)
        assert [len(b) for b in service.batches()] == [10, 10, 5]


def test_batches_are_cut_by_bytes(tmp_path: Path) -> None:
    service = FakeService()
    per_fragment = 8 * len(ROW) + 32
    with make(
        service, tmp_path, max_batch_bytes=3 * per_fragment, flush_interval_s=SLOW
    ) as reporter:
        for _ in range(7):
            reporter.log(0, ROW)
        assert reporter.flush(5)
    assert [len(b) for b in service.batches()] == [3, 3, 1]


def test_batches_are_cut_by_time(tmp_path: Path) -> None:
    service = FakeService()
    with make(service, tmp_path, flush_interval_s=0.1) as reporter:
        t0 = time.monotonic()
        reporter.log(0, ROW)
        reporter.log(0, ROW)
        assert wait_until(lambda: len(service.batches()) == 1, timeout=3)
        waited = service.received[-1].at - t0
        assert 0.08 <= waited < 2.0
        assert len(service.batches()[0]) == 2
    service = FakeService()
    with make(service, tmp_path, flush_interval_s=SLOW) as reporter:
        reporter.log(0, ROW)
        time.sleep(0.4)
        assert service.batches() == []  # nothing was due: neither count, bytes nor time


def test_compact_form_and_gzip_only_when_it_pays(tmp_path: Path) -> None:
    service = FakeService()
    with make(service, tmp_path, gzip_min_bytes=2048, flush_interval_s=SLOW) as reporter:
        reporter.log(0, ROW)
        assert reporter.flush(5)
        for step in range(1, 60):
            reporter.log(step, ROW)
        assert reporter.flush(5)
    small, large = [r for r in service.received if r.batch is not None]
    assert "content-encoding" not in small.headers
    assert large.headers["content-encoding"] == "gzip"
    assert large.size >= 2048  # the size the fake saw after decompressing
    assert len(service.fragments) == 60


def test_wire_body_is_the_columnar_form(tmp_path: Path) -> None:
    bodies: list[bytes] = []
    service = FakeService()
    inner = service.handle

    def spy(request):  # type: ignore[no-untyped-def]
        body = request.read()
        if request.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        bodies.append(body)
        return inner(request)

    service.handle = spy  # type: ignore[method-assign]
    with make(service, tmp_path, flush_interval_s=SLOW) as reporter:
        reporter.log(3, ROW)
        reporter.commit(3)
        assert reporter.flush(5)
    body = json.loads(bodies[-1])
    assert body["columnar"]["metrics"] == list(ROW)
    assert body["columnar"]["step"] == [3] and body["columnar"]["seq"] == [0]
    assert body["commits"] == [{"step": 3, "rank": 0, "fragments": 1}]


def test_fragments_with_different_metrics_share_a_batch(tmp_path: Path) -> None:
    service = FakeService()
    with make(service, tmp_path, flush_interval_s=SLOW) as reporter:
        reporter.log(0, {"m0": 1.0})
        reporter.log(0, {"m2": 2.0, "m1": 3.0})
        assert reporter.flush(5)
    assert len(service.batches()) == 1
    assert service.fragments == {(0, 0, 0): {"m0": 1.0}, (0, 0, 1): {"m2": 2.0, "m1": 3.0}}


def test_every_commit_travels_with_or_after_its_fragments(tmp_path: Path) -> None:
    service = FakeService()
    with make(service, tmp_path, max_batch_fragments=3, flush_interval_s=0.01) as reporter:
        for step in range(30):
            for _ in range(step % 5):
                reporter.log(step, ROW)
            reporter.commit(step)
            if step % 7 == 0:
                time.sleep(0.02)
        assert reporter.flush(5)
    seen: set[tuple[int, int]] = set()
    for batch in service.batches():
        seen.update((s, q) for s, _, q in zip(batch.steps, batch.ranks, batch.seqs, strict=True))
        for c in batch.commits:
            assert {(c.step, q) for q in range(c.fragments)} <= seen
    assert len(service.commits) == 30


def test_stats_line_is_logged_periodically(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    service = FakeService()
    caplog.set_level(logging.INFO, logger="steptally.reporter")
    options = ReporterOptions(flush_interval_s=0.02)
    with fake_reporter(service, tmp_path, SPEC, options, log_every_s=0.05) as reporter:
        reporter.log(0, ROW)
        assert reporter.flush(5)
        assert wait_until(lambda: any("sent=1 " in m for m in caplog.messages), timeout=3)
    assert reporter.stats().to_dict()["sent"] == 1
