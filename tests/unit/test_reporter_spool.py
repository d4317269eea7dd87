"""Lossless through outages: spool while the service is away, send the spool in order
before newer data, replay a crashed process's spool, and drop (counted) only when both
memory and spool are full."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.reporting import FAST, fake_reporter

from steptally.client.algebra import Kind
from steptally.client.reporter import Reporter, ReporterOptions
from steptally.client.reporter.capture import Capture, Entry
from steptally.client.reporter.fake import FakeService
from steptally.client.reporter.intake import Intake
from steptally.client.reporter.parcel import Parcel
from steptally.client.reporter.spool import Spool
from steptally.client.wire import Commit

SPEC = {"metrics": {"a": "sum", "n": "count"}}


def make(service: FakeService, spool: Path, options: ReporterOptions = FAST, **kw: int) -> Reporter:
    return fake_reporter(service, spool, SPEC, options, **kw)


def log_steps(reporter: Reporter, steps: range, per_step: int = 4) -> None:
    for step in steps:
        for i in range(per_step):
            reporter.log(step, {"a": step + i / 8, "n": i})
        reporter.commit(step)


def files(spool: Path) -> list[str]:
    return sorted(p.name for p in spool.glob("*.json*"))


def steps_in_arrival_order(service: FakeService) -> list[int]:
    out: list[int] = []
    for batch in service.batches():
        out += batch.steps
    return out


def test_spools_while_down_and_sends_the_spool_first_when_back(tmp_path: Path) -> None:
    service = FakeService()
    spool = tmp_path / "spool"
    options = ReporterOptions(flush_interval_s=0.01, backoff_base_s=0.01, max_batch_fragments=4)
    with make(service, spool, options) as reporter:
        log_steps(reporter, range(1))
        assert reporter.flush(5)
        service.down = True
        log_steps(reporter, range(1, 6))
        assert not reporter.flush(0.5)
        stats = reporter.stats()
        assert stats.spooled == 20 and stats.queued == 20 and stats.sent == 4
        assert len(files(spool)) >= 2  # one file per batch
        service.down = False
        log_steps(reporter, range(6, 9))  # newer data, logged as the service returns
        assert reporter.flush(5)
        assert reporter.stats().queued == 0
    assert steps_in_arrival_order(service) == sorted(steps_in_arrival_order(service))
    assert {s for s, _ in service.commits} == set(range(9))
    assert len(service.fragments) == 36 and files(spool) == []


def test_a_new_reporter_replays_the_spool_a_closed_one_left(tmp_path: Path) -> None:
    service = FakeService()
    spool = tmp_path / "spool"
    service.down = True
    with make(service, spool) as reporter:
        log_steps(reporter, range(3))
        assert not reporter.close(timeout=0.3)
    assert files(spool)
    service.down = False
    with make(service, spool) as successor:
        assert successor.flush(5)  # replays without a single log() call
        assert successor.stats().sent == 12
    assert len(service.fragments) == 12 and files(spool) == []
    assert service.commits == {(0, 0): 4, (1, 0): 4, (2, 0): 4}


CRASH = """
import os, time, httpx
from steptally.client.reporter import Reporter, ReporterOptions
def refuse(request):
    raise httpx.ConnectError("refused")
r = Reporter("http://steptally.test", run="r", spec={"metrics": {"a": "sum", "n": "count"}},
             rank=0, world_size=1, transport=httpx.MockTransport(refuse), spool_dir=SPOOL,
             options=ReporterOptions(flush_interval_s=0.01, backoff_base_s=0.01))
for step in range(5):
    for i in range(3):
        r.log(step, {"a": step * 10.0 + i, "n": 1})
    r.commit(step)
while r.stats().spooled < 15:
    time.sleep(0.01)
os._exit(3)  # a crash: no close(), no exit hook
"""


def test_a_new_reporter_replays_a_crashed_process_spool_in_order(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    code = CRASH.replace("SPOOL", repr(str(spool)))
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 3
    (spool / ".tmp-000000000099-1-1f-0c.json").write_bytes(b"{half a wri")
    service = FakeService()
    with make(service, spool) as successor:
        log_steps(successor, range(5, 7))
        assert successor.flush(5)
    arrival = steps_in_arrival_order(service)
    assert arrival[:15] == [s for s in range(5) for _ in range(3)]
    assert arrival == sorted(arrival)
    assert service.fragments[4, 0, 2] == {"a": 42.0, "n": 1.0}
    assert len(service.commits) == 7 and list(spool.iterdir()) == []


def test_spool_files_are_named_in_order_and_written_atomically(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=10_000)
    for i in range(12):
        assert spool.write(Parcel(b"{}" * (i + 1), i % 2 == 0, i, 1))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [int(n.split("-")[2].removesuffix("f")) for n in names] == list(range(12))
    assert not any(n.startswith(".tmp-") for n in names)
    again = Spool(tmp_path, max_bytes=10_000)
    found = again.scan()
    assert [p.fragments for p in found] == list(range(12))
    assert [p.gzipped for p in found] == [i % 2 == 0 for i in range(12)]
    assert again.nbytes == sum(2 * (i + 1) for i in range(12))
    assert again.write(Parcel(b"{}", False, 99, 0))
    assert sorted(p.name for p in tmp_path.iterdir())[-1].split("-")[2] == "99f"
    assert not Spool(tmp_path / "x", max_bytes=3).write(Parcel(b"{}{}", False, 1, 0))


def test_drops_only_when_memory_and_spool_are_full_and_counts_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    service = FakeService()
    spool = tmp_path / "spool"
    tight = ReporterOptions(
        flush_interval_s=0.01,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
        max_batch_fragments=4,
        max_queue_bytes=600,
        gzip_min_bytes=1 << 20,
    )
    with make(service, spool, tight, max_spool_bytes=1500) as reporter:
        log_steps(reporter, range(1))
        assert reporter.flush(5)
        service.down = True
        log_steps(reporter, range(1, 40))  # never raises
        assert not reporter.flush(1.0)
        # Every fragment ends dropped or in the outbox: spooled, or in memory when the
        # spool filled first (a parcel of commits alone may take the spool's room).
        outbox = reporter._worker.outbox
        deadline = time.monotonic() + 5  # a batch may be between the batcher and the outbox
        while (stats := reporter.stats()).dropped + outbox.fragments() < 156:
            assert time.monotonic() < deadline, stats
            time.sleep(0.01)
        assert stats.dropped > 0 and stats.spooled > 0
        assert stats.dropped + outbox.fragments() == 156  # every fragment is accounted for
        assert stats.spooled == outbox.fragments() - outbox.in_memory_fragments()
        assert "memory and spool are full: dropped" in caplog.text
        assert sum(p.stat().st_size for p in spool.glob("*.json*")) <= 1500
        service.down = False
        assert reporter.flush(5)
        sent = reporter.stats().sent
    assert sent == 4 + 156 - stats.dropped
    missing = sum(
        n - sum(1 for s, _, _ in service.fragments if s == step)
        for (step, _), n in service.commits.items()
    )
    assert missing == stats.dropped  # the commits show which steps are incomplete


def test_the_in_memory_queue_is_bounded_and_still_numbers_what_it_drops() -> None:
    capture = Capture({"a": Kind.SUM, "b": Kind.SUM})
    intake = Intake(0, max_items=3, max_bytes=1 << 20, capture=capture)
    accepted = [intake.put(Entry(7, ("a",), [1.0])) for _ in range(5)]
    assert accepted == [True, True, True, False, False]
    intake.commit(7)
    drained = intake.drain()
    assert [type(item).__name__ for item in drained] == ["Entry"] * 3 + ["Commit"]
    assert [item.seq for item in drained[:3]] == [0, 1, 2]  # type: ignore[union-attr]
    assert drained[3] == Commit(7, 0, 5)  # the step will show two missing fragments
    small = Intake(0, max_items=100, max_bytes=100, capture=capture)
    assert [small.put(Entry(0, ("a", "b"), [1.0, 2.0])) for _ in range(3)] == [
        True,
        True,
        False,
    ]


def test_the_one_frame_log_is_bounded_like_the_checked_path_and_numbers_what_it_drops() -> None:
    checked: list[int] = []
    intake = Intake(0, max_items=3, max_bytes=1 << 20, capture=Capture({"a": Kind.SUM}))
    log = intake.logger(lambda step, fragments: checked.append(step))
    log(7, {"a": 1.0})  # no fragment of one value was checked yet: the checked path
    assert checked == [7] and len(intake) == 0
    assert intake.put(Entry(7, ("a",), [1.0]))  # what the checked path queues
    for _ in range(4):
        log(7, {"a": 2.0})
    assert checked == [7] and len(intake) == 3  # two queued here, two dropped
    intake.commit(7)
    drained = intake.drain()
    assert [item.seq for item in drained[:3]] == [0, 1, 2]  # type: ignore[union-attr]
    assert [item.values for item in drained[:3]] == [[1.0], [2.0], [2.0]]  # type: ignore[union-attr]
    assert drained[3] == Commit(7, 0, 5)  # the step will show two missing fragments


def test_the_queue_bound_by_bytes_is_a_length_set_by_the_largest_fragment() -> None:
    """A fragment waits only while fewer than max_bytes // (8n + 32) items do, n the most
    values of any fragment so far (so what waits never holds more than max_bytes), on
    the one-frame path and the checked one alike; every call is accepted and counted,
    dropped ones too."""
    names = [f"m{i}" for i in range(10)]  # 8 * 10 + 32 = 112 bytes a fragment
    intake = Intake(
        0, max_items=100, max_bytes=1000, capture=Capture(dict.fromkeys(names, Kind.SUM))
    )
    log = intake.logger(lambda step, fragments: None)
    assert intake.bound(1) == 25 and intake.bound(10) == 8
    assert intake.put(Entry(3, ("m0",), [1.0]))  # one value: registers room for 25
    assert intake.float_sizes == {1: 25}
    assert intake.put(Entry(3, tuple(names), [1.0] * 10))  # ten: room for 8, for both
    assert intake.float_sizes == {1: 8, 10: 8} and intake.bound(1) == 8
    for _ in range(7):
        log(3, dict.fromkeys(names, 2.0))
    log(3, {"m0": 3.0})
    assert len(intake) == 8 and intake.accepted() == 10  # two dropped, one of each size
    intake.commit(3)
    assert intake.accepted() == 11
    drained = intake.drain()
    assert len(drained) == 9 and drained[-1] == Commit(3, 0, 10)  # 8 queued + 2 dropped
    assert intake.accepted() == 11 and len(intake) == 0


def test_memory_of_a_reporter_is_bounded_while_down(tmp_path: Path) -> None:
    service = FakeService()
    service.down = True
    spool = tmp_path / "spool"
    options = ReporterOptions(
        flush_interval_s=0.01,
        backoff_base_s=0.01,
        max_queue_bytes=2000,
        max_batch_fragments=2,
    )
    with make(service, spool, options) as reporter:
        worker = reporter._worker
        peak = 0
        for step in range(100):
            log_steps(reporter, range(step, step + 1), per_step=2)
            peak = max(peak, worker.outbox._memory_bytes)
            while len(worker.intake):  # the same bound holds the intake: let it drain
                time.sleep(0.001)
        assert not reporter.flush(0.3)
        assert peak <= 2000
        assert reporter.stats().dropped == 0
        service.down = False
        assert reporter.flush(10)
    assert len(service.fragments) == 200


def test_close_while_the_service_is_down_is_quick_and_keeps_everything(tmp_path: Path) -> None:
    service = FakeService()
    service.down = True
    spool = tmp_path / "spool"
    reporter = make(service, spool)
    log_steps(reporter, range(3))
    deadline = time.monotonic() + 5
    while reporter.stats().retried == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    assert not reporter.close(timeout=30)
    assert time.monotonic() - t0 < 5  # not the 30 s asked for: the spool holds it all
    assert sum(int(name.split("-")[2][:-1]) for name in files(spool)) == 12
    assert not reporter.flush(1)  # closed with data left: nothing more will be sent


def test_the_default_spool_is_in_the_cache_keyed_by_url_run_and_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from steptally.client.reporter.options import default_spool_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    here = default_spool_dir("http://a", "run-1", 3)
    assert here.parent == tmp_path / "steptally" / "spool"
    assert here.name.startswith("run-1-r3-")
    assert here == default_spool_dir("http://a", "run-1", 3)
    keys = [("http://b", "run-1", 3), ("http://a", "run-2", 3), ("http://a", "run-1", 4)]
    others = {default_spool_dir(*key) for key in keys}
    assert here not in others and len(others) == 3
    with Reporter("http://a", run="run-1", spec=SPEC, rank=3, world_size=4) as reporter:
        assert reporter.spool_dir == here
