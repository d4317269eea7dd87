"""Server-sent events of finalisations, against a real ``steptally serve``: one event
per finalisation, replay after Last-Event-ID, clean shutdown; on both databases."""

from __future__ import annotations

import queue
import signal
import threading
import time
from typing import Any

import httpx
import orjson
import pytest

from tests.support.served import ServedService

Event = dict[str, Any]


class Stream:
    """``GET /v1/runs/{run}/events`` read on a thread; events arrive on a queue."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.events: queue.Queue[Event] = queue.Queue()
        self.ended = threading.Event()  # the server ended the stream cleanly
        self.error: Exception | None = None
        self.start_id: str | None = None  # the id of the stream's first message (no data)
        self._live = threading.Event()
        self._stop = threading.Event()
        self._client = httpx.Client(timeout=httpx.Timeout(5, read=None))
        self._thread = threading.Thread(target=self._read, args=(url, headers or {}), daemon=True)
        self._thread.start()
        assert self._live.wait(10), "the stream never said it was live"

    def _read(self, url: str, headers: dict[str, str]) -> None:
        try:
            self._lines(url, headers)
            self.ended.set()
        except Exception as exc:  # a stream closed by the test may end any way
            if not self._stop.is_set():
                self.error = exc

    def _lines(self, url: str, headers: dict[str, str]) -> None:
        with self._client.stream("GET", url, headers=headers) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            fields: Event = {}
            for line in response.iter_lines():
                if line == ": live":
                    self._live.set()
                elif line.startswith(":"):
                    continue
                elif line:
                    name, _, value = line.partition(":")
                    fields[name] = value.removeprefix(" ")
                elif "data" in fields:
                    self.events.put(fields)
                    fields = {}
                elif fields:  # an id without data: what to resume from, no event
                    self.start_id = self.start_id or fields.get("id")
                    fields = {}

    def take(self, n: int, timeout: float = 15) -> list[Event]:
        deadline = time.monotonic() + timeout
        out = [self.events.get(timeout=max(0.01, deadline - time.monotonic())) for _ in range(n)]
        return out

    def nothing_more(self, wait: float = 0.5) -> bool:
        try:
            self.events.get(timeout=wait)
        except queue.Empty:
            return True
        return False

    def close(self) -> None:
        """Stop reading; the thread ends when the server closes the stream."""
        self._stop.set()
        self._client.close()


def _register(base: str, world_size: int = 2) -> None:
    body = {
        "name": "r",
        "world_size": world_size,
        "metrics": {"a": "sum", "n": "count"},
        "derived": {"mean": "a / n"},
        "step_timeout_s": 0.5,
    }
    assert httpx.post(f"{base}/v1/runs", json=body).status_code == 201


def _send(base: str, step: int, rank: int, a: float, commit: bool = True) -> Any:
    body = {
        "fragments": [{"step": step, "rank": rank, "seq": 0, "values": {"a": a, "n": 1}}],
        "commits": [{"step": step, "rank": rank, "fragments": 1}] if commit else [],
    }
    response = httpx.post(f"{base}/v1/runs/r/fragments", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _complete(base: str, step: int) -> None:
    _send(base, step, 0, float(step))
    _send(base, step, 1, 1.0)


def _data(event: Event) -> Any:
    assert event["event"] == "step"
    return orjson.loads(event["data"])


def test_an_event_per_finalisation_partial_and_revision(served: ServedService) -> None:
    base = served.url
    _register(base)
    stream = Stream(f"{base}/v1/runs/r/events")
    try:
        _complete(base, 0)
        _send(base, 1, 0, 5.0)  # rank 1 is late: the sweeper finalises step 1 partial
        first, partial = stream.take(2)
        _send(base, 1, 1, 2.0)  # and the late rank revises it
        (revised,) = stream.take(1)
        assert stream.nothing_more()
    finally:
        stream.close()
    seen = [(d["step"], d["status"], d["revision"]) for d in map(_data, (first, partial, revised))]
    assert seen == [(0, "complete", 1), (1, "partial", 1), (1, "complete", 2)]
    assert _data(partial)["metrics"]["a"]["value"] == 5.0
    assert _data(partial)["ranks_missing"] == [1]
    assert _data(first) == httpx.get(f"{base}/v1/runs/r/steps/0").json()
    assert _data(revised) == httpx.get(f"{base}/v1/runs/r/steps/1").json()
    assert len({first["id"], partial["id"], revised["id"]}) == 3


@pytest.mark.parametrize("how", ["header", "query"])
def test_reconnect_replays_exactly_the_missed_finalisations(
    served: ServedService, how: str
) -> None:
    base = served.url
    _register(base)
    stream = Stream(f"{base}/v1/runs/r/events")
    for step in (0, 1):
        _complete(base, step)
    seen = stream.take(2)
    stream.close()
    for step in (2, 3):
        _complete(base, step)
    _send(base, 4, 0, 1.0)  # partial once the sweeper runs, while nobody listens
    time.sleep(1.0)
    last = seen[-1]["id"]
    if how == "header":
        again = Stream(f"{base}/v1/runs/r/events", headers={"Last-Event-ID": last})
    else:
        again = Stream(f"{base}/v1/runs/r/events?last_event_id={httpx.URL(last)}")
    try:
        missed = again.take(3)
        assert again.nothing_more()
        _complete(base, 5)
        (live,) = again.take(1)
    finally:
        again.close()
    assert [_data(e)["step"] for e in seen] == [0, 1]
    got = [(_data(e)["step"], _data(e)["status"]) for e in [*missed, live]]
    assert got == [(2, "complete"), (3, "complete"), (4, "partial"), (5, "complete")]
    assert _data(missed[0]) == httpx.get(f"{base}/v1/runs/r/steps/2").json()


def test_every_stream_starts_with_an_id_to_resume_from(served: ServedService) -> None:
    """A stream that ends before its first event still leaves its client a place: the
    first message's id, after every finalisation stored when it began."""
    base = served.url
    _register(base)
    first = Stream(f"{base}/v1/runs/r/events")
    first.close()
    assert first.start_id == "0.0:0:0"  # nothing finalised yet: the origin
    for step in (0, 1):
        _complete(base, step)
    watching = Stream(f"{base}/v1/runs/r/events")
    replay = Stream(f"{base}/v1/runs/r/events", headers={"Last-Event-ID": first.start_id})
    _, one = replay.take(2)  # both steps, from the origin
    replay.close()
    later = Stream(f"{base}/v1/runs/r/events")
    later.close()
    assert later.start_id == one["id"]  # step 1's place: the newest
    _complete(base, 2)
    assert [_data(e)["step"] for e in watching.take(1)] == [2]
    watching.close()
    again = Stream(f"{base}/v1/runs/r/events", headers={"Last-Event-ID": later.start_id})
    try:
        assert [_data(e)["step"] for e in again.take(1)] == [2]
        assert again.nothing_more()
    finally:
        again.close()


def test_unknown_run_and_bad_cursor_are_json_errors(served: ServedService) -> None:
    base = served.url
    _register(base)
    unknown = httpx.get(f"{base}/v1/runs/zz/events")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "unknown_run"
    for headers, params, where in (
        ({"Last-Event-ID": "junk"}, {}, "header.Last-Event-ID"),
        ({}, {"last_event_id": "1.0:x:1"}, "query.last_event_id"),
    ):
        bad = httpx.get(f"{base}/v1/runs/r/events", headers=headers, params=params)
        assert bad.status_code == 422
        assert (bad.json()["error"]["code"], bad.json()["error"]["where"]) == (
            "invalid_payload",
            where,
        )


def test_open_streams_end_when_the_server_stops(served: ServedService) -> None:
    base = served.url
    _register(base)
    streams = [Stream(f"{base}/v1/runs/r/events") for _ in range(3)]
    assert served.proc is not None
    proc = served.proc
    started = time.monotonic()
    served.stop(signal.SIGTERM)
    assert time.monotonic() - started < 5
    assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    for s in streams:
        assert s.ended.wait(5), s.error
        s.close()
    log = served.log.read_text()
    assert "Traceback" not in log and "Warning" not in log and "ERROR" not in log, log
