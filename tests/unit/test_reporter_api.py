"""The reporter's public API, pinned: what a training script imports and calls."""

from __future__ import annotations

import inspect
from pathlib import Path

import steptally.client
import steptally.client.reporter as reporter_module
from steptally.client.algebra import MetricSpec
from steptally.client.reporter import Reporter
from steptally.client.reporter.fake import FakeService


def test_exported_members() -> None:
    assert set(reporter_module.__all__) == {
        "Closed",
        "FragmentError",
        "IdentityError",
        "Reporter",
        "ReporterClosed",
        "ReporterError",
        "ReporterOptions",
        "Stats",
    }
    assert steptally.client.Reporter is Reporter
    assert "Reporter" in steptally.client.__all__


def test_reporter_signature_and_methods() -> None:
    params = inspect.signature(Reporter).parameters
    assert list(params)[:6] == ["url", "run", "spec", "rank", "world_size", "token"]
    assert {"transport", "spool_dir", "max_spool_bytes", "log_every_s", "options"} <= set(params)
    for method in ("log", "commit", "flush", "close", "stats", "__enter__", "__exit__"):
        assert callable(getattr(Reporter, method))


def test_spec_may_be_a_metric_spec_or_its_json(tmp_path: Path) -> None:
    service = FakeService()
    spec = MetricSpec.build({"a": "sum", "n": "count"}, {"mean": "a / n"})
    for given in (spec, spec.to_json()):
        with Reporter(
            "http://steptally.test",
            run="api",
            spec=given,
            rank=0,
            world_size=1,
            token="secret",
            transport=service.transport(),
            spool_dir=tmp_path,
        ) as reporter:
            reporter.log(0 if given is spec else 1, {"a": 1.0, "n": 2})
            assert reporter.flush(5)
    assert service.specs["api"] == spec
    assert all(r.headers["authorization"] == "Bearer secret" for r in service.received)
