"""An in-memory stand-in for the service, for testing code that uses a Reporter.

    service = FakeService()
    reporter = Reporter("http://steptally", run="r", spec=spec, rank=0, world_size=1,
                        transport=service.transport())
    ...
    service.fail_next(503, httpx.ConnectError("down"))   # script failures
    service.down = True                                  # or refuse every connection

It follows the REST contract for what a reporter sends: run registration (201, 200,
409 ``spec_conflict``) and fragment batches in either wire form, gzipped or not,
deduplicated by ``(step, rank, seq)``.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import httpx

from steptally.client.algebra import MetricSpec, SpecConflict
from steptally.client.wire import FragmentBatch, Value, decode_batch


@dataclass(frozen=True, slots=True)
class Received:
    """One request as the fake saw it; ``batch`` is None for anything but fragments."""

    at: float
    path: str
    headers: dict[str, str]
    size: int
    batch: FragmentBatch | None


def _error(status: int, code: str, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": message, "where": None}})


class FakeService:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.down = False
        self.received: list[Received] = []
        self.attempts: list[tuple[float, str]] = []  # every request, failed ones included
        self.specs: dict[str, MetricSpec] = {}
        self.fragments: dict[tuple[int, int, int], dict[str, Value]] = {}
        self.commits: dict[tuple[int, int], int] = {}
        self.duplicates = 0
        self._script: deque[int | httpx.Response | Exception] = deque()

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def fail_next(self, *answers: int | httpx.Response | Exception) -> None:
        """Answer the next requests with these statuses, responses or raised errors."""
        with self.lock:
            self._script.extend(answers)

    def attempt_times(self, suffix: str = "/fragments") -> list[float]:
        return [at for at, path in self.attempts if path.endswith(suffix)]

    def batches(self) -> list[FragmentBatch]:
        return [r.batch for r in self.received if r.batch is not None]

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = request.read()
        with self.lock:
            self.attempts.append((time.monotonic(), request.url.path))
            scripted = self._script.popleft() if self._script else None
            if self.down:
                raise httpx.ConnectError("connection refused (fake service is down)")
            if isinstance(scripted, Exception):
                raise scripted
            if isinstance(scripted, httpx.Response):
                return scripted
            if isinstance(scripted, int):
                return _error(scripted, f"http_{scripted}", f"scripted {scripted}")
            return self._answer(request, body)

    def _answer(self, request: httpx.Request, body: bytes) -> httpx.Response:
        headers = dict(request.headers)
        if headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        path = request.url.path
        if path == "/v1/runs":
            self.received.append(Received(time.monotonic(), path, headers, len(body), None))
            return self._register(json.loads(body))
        run = path.split("/")[3]
        if run not in self.specs:
            return _error(404, "unknown_run", f"no run named {run!r}")
        batch = decode_batch(json.loads(body))
        self.received.append(Received(time.monotonic(), path, headers, len(body), batch))
        accepted = 0
        for step, rank, seq, values in batch.rows():
            if (step, rank, seq) in self.fragments:
                self.duplicates += 1
            else:
                self.fragments[step, rank, seq] = values
                accepted += 1
        for c in batch.commits:
            self.commits[c.step, c.rank] = c.fragments
        return httpx.Response(
            200,
            json={
                "accepted": accepted,
                "duplicates": len(batch) - accepted,
                "commits": len(batch.commits),
                "finalised": [],
                **({"rejected": []} if request.url.params.get("partial") else {}),
            },
        )

    def _register(self, data: dict[str, Any]) -> httpx.Response:
        spec = MetricSpec.from_json(data)
        name = data["name"]
        old = self.specs.get(name)
        if old is None:
            self.specs[name] = spec
            return httpx.Response(201, json=data)
        try:
            self.specs[name] = old.merged_with(spec)
        except SpecConflict as exc:
            return _error(409, "spec_conflict", str(exc))
        return httpx.Response(200, json=data)
