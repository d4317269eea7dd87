"""The reporter against a real ``steptally serve`` under poisoned and failing conditions.

One bad item never costs the rest of its batch; a spool is never deleted unless
delivered; nothing is lost without being counted.
"""

from __future__ import annotations

import gzip
import http.server
import json
import logging
import threading
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


def _files(spool: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(spool.glob("*.json*"))}


def _spooled_fragments(spool: Path) -> int:
    return sum(int(name.split("-")[2][:-1]) for name in _files(spool))


def test_a_registration_conflict_keeps_the_spool_byte_for_byte(tmp_path: Path) -> None:
    service = ServedService(_sqlite(tmp_path), tmp_path / "service.log")  # not started: down
    spool = tmp_path / "spool"
    fast = ReporterOptions(flush_interval_s=0.01, backoff_base_s=0.01, backoff_max_s=0.05)
    try:
        first = Reporter(service.url, run="r", spec=SPEC, rank=0, world_size=1,
                         spool_dir=spool, options=fast)  # fmt: skip
        for step in range(4):
            first.log(step, {"a": 1.0, "n": 1})
            first.commit(step)
        assert not first.close(2)
        before = _files(spool)
        assert _spooled_fragments(spool) == 4
        service.start()
        _register(service.url, world_size=1, metrics={"a": "max"})  # now the spec conflicts
        second = Reporter(service.url, run="r", spec=SPEC, rank=0, world_size=1,
                          spool_dir=spool, options=fast)  # fmt: skip
        assert second.flush(10)
        stats = second.stats()
        second.close(2)
    finally:
        service.stop()
    assert stats.failed and (stats.sent, stats.rejected, stats.dropped) == (0, 0, 0)
    assert "spec_conflict" in (stats.last_error or "")
    assert f"stays in the spool at {spool}" in (stats.last_error or "")
    assert _files(spool) == before


def test_a_full_spool_counts_exactly_what_it_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = tmp_path / "spool"
    down = ServedService(_sqlite(tmp_path), tmp_path / "service.log", migrate=False)
    options = ReporterOptions(flush_interval_s=0.01, backoff_base_s=0.01, backoff_max_s=0.05)
    reporter = Reporter(down.url, run="r", spec=SPEC, rank=0, world_size=1,
                        spool_dir=spool, max_spool_bytes=4096, options=options)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="steptally.reporter"):
        for step in range(3000):
            reporter.log(step, {"a": 1.0, "n": 1})
        reporter.close(2)
        stats = reporter.stats()
    on_disk = _spooled_fragments(spool)
    assert sum(len(b) for b in _files(spool).values()) <= 4096
    assert 0 < on_disk < 3000
    assert stats.spooled == on_disk
    assert stats.dropped == 3000 - on_disk  # every fragment lost is counted, exactly
    assert stats.sent == stats.rejected == 0
    assert "full" in (stats.last_error or "")
    warnings = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert 1 <= len(warnings) <= 3  # rate-limited, not one per batch


def test_an_unusable_spool_directory_is_an_oserror_naming_it(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(OSError, match=str(blocker / "spool")):
        Reporter("http://127.0.0.1:9", run="r", spec=SPEC, rank=0, world_size=1,
                 spool_dir=blocker / "spool")  # fmt: skip


class PoisonProxy:
    """A tiny HTTP proxy to the service that answers 500 to any batch holding ``step``."""

    def __init__(self, upstream: str, step: int) -> None:
        self.upstream, self.step, self.refused = upstream, step, 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if proxy.poisoned(body, self.headers.get("content-encoding")):
                    proxy.refused += 1
                    self._answer(
                        500, b'{"error":{"code":"internal","message":"boom","where":null}}'
                    )
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                got = httpx.post(proxy.upstream + self.path, content=body, headers=headers)
                self._answer(got.status_code, got.content)

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def poisoned(self, body: bytes, encoding: str | None) -> bool:
        data = json.loads(gzip.decompress(body) if encoding == "gzip" else body)
        columnar = data.get("columnar") if isinstance(data, dict) else None
        return isinstance(columnar, dict) and self.step in columnar.get("step", [])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_batch_answered_500_every_time_is_quarantined_and_later_steps_land(
    serve: Serve, tmp_path: Path
) -> None:
    service = serve(_sqlite(tmp_path))
    proxy = PoisonProxy(service.url, step=3)
    spool = tmp_path / "spool"
    options = ReporterOptions(
        flush_interval_s=0.01, backoff_base_s=0.01, backoff_max_s=0.05, max_server_errors=3
    )
    try:
        reporter = Reporter(proxy.url, run="r", spec=SPEC, rank=0, world_size=1,
                            spool_dir=spool, options=options)  # fmt: skip
        for step in range(8):
            reporter.log(step, {"a": step + 0.25, "n": 1})
            reporter.commit(step)
            assert reporter.flush(20)  # one batch a step; the poisoned one never wedges
        stats = reporter.stats()
        reporter.close(5)
    finally:
        proxy.close()
    assert proxy.refused == 4  # the first answer and 3 more: max_server_errors
    assert (stats.sent, stats.quarantined, stats.dropped, stats.queued) == (7, 1, 0, 0)
    for step in (0, 1, 2, 4, 5, 6, 7):
        got = _step(service.url, step)
        assert (got["status"], got["metrics"]["a"]["value"]) == ("complete", step + 0.25)
    assert httpx.get(f"{service.url}/v1/runs/r/steps/3").status_code == 404
    (kept,) = (spool / "quarantine").glob("*.json*")
    assert kept.name.split("-")[2:] == ["1f", "1c.json"]
    error = (spool / "quarantine" / (kept.name.split(".")[0] + ".error")).read_text()
    assert "HTTP 500 internal: boom" in error
    assert not _files(spool)
