"""After os.fork() the child gets fresh threads, a fresh connection pool and none of
the parent's queued data; both keep reporting."""

from __future__ import annotations

import json
import os
import threading
import warnings
from pathlib import Path

import pytest

from steptally.client.reporter import Reporter, ReporterOptions
from steptally.client.reporter.fake import FakeService

SPEC = {"metrics": {"a": "sum"}}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_restarts_the_threads_and_delivers(tmp_path: Path) -> None:
    service = FakeService()
    result = tmp_path / "child.json"
    options = ReporterOptions(flush_interval_s=30.0)  # only flush() sends
    with Reporter(
        "http://steptally.test",
        run="r",
        spec=SPEC,
        rank=0,
        world_size=2,
        transport=service.transport(),
        spool_dir=tmp_path / "spool",
        options=options,
    ) as reporter:
        reporter.log(0, {"a": 1.0})
        assert reporter.flush(5)
        reporter.log(1, {"a": 2.0})  # queued in the parent when it forks
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
            pid = os.fork()
        if pid == 0:  # the child
            code = 1
            try:
                before = {t.name for t in threading.enumerate()}
                reporter.log(2, {"a": 3.0})
                reporter.commit(2)
                ok = reporter.flush(10)
                names = {t.name for t in threading.enumerate()}
                result.write_text(
                    json.dumps(
                        {
                            "flushed": ok,
                            "threads_before": sorted(
                                n for n in before if n.startswith("steptally")
                            ),
                            "threads_after": sorted(n for n in names if n.startswith("steptally")),
                            "keys": sorted(service.fragments),
                            "commits": sorted(service.commits),
                            "sent": reporter.stats().sent,
                        }
                    )
                )
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        reporter.commit(1)
        assert reporter.flush(5)
    child = json.loads(result.read_text())
    assert child["flushed"] is True
    assert child["threads_before"] == []  # the parent's threads do not survive a fork
    assert child["threads_after"] == ["steptally-batcher", "steptally-sender"]
    assert child["sent"] == 1  # its own fragment only: the parent's step 1 is not resent
    assert [2, 0, 0] in child["keys"] and [1, 0, 0] not in child["keys"]
    assert child["commits"] == [[2, 0]]
    assert sorted(service.fragments) == [(0, 0, 0), (1, 0, 0)]  # the parent's, once each
    assert service.commits == {(1, 0): 1}
