"""The direct lane (``service/api/direct.py``): the reporter's request served by the
HTTP protocol itself, through a real uvicorn server on a real socket, answers every
request as the ASGI lane does, byte for byte but for the date, on both stores."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import orjson
import pytest
import uvicorn

from steptally.service import serving
from steptally.service.api.direct import DirectLane, LaneProtocol, direct_of
from steptally.service.app import create_app
from steptally.service.settings import Settings
from tests.integration.test_ingest_lane import (
    JSON,
    REQUESTS,
    SETTINGS,
    _busy,
    _requests_counted,
    _rows,
)
from tests.support.served import free_port

SPEC = {"name": "r", "world_size": 2, "metrics": {"a": "sum", "n": "count"}}


class Server:
    """An app under uvicorn in a thread of its own, on a port of its own."""

    def __init__(self, app: Any, direct: bool) -> None:
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        http: Any = LaneProtocol if direct else "httptools"
        config = uvicorn.Config(app, port=self.port, http=http, log_config=None, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.served: list[str] = []  # the requests the direct lane took

    def __enter__(self) -> Server:
        direct = direct_of(self.app)
        if direct is not None:
            serve, served = direct.serve, self.served

            def counted(scope: Any, body: bytes, reply: Any) -> bool:
                taken = serve(scope, body, reply)
                if taken:
                    served.append(scope["path"])
                return taken

            direct.serve = counted  # type: ignore[method-assign]
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *_: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture
def serve(db_url: str, empty_database: Callable[[str], None]) -> Iterator[Callable[..., Server]]:
    """``serve(direct, **settings)``: a fresh app over an emptied ``db_url``, served."""
    with ExitStack() as stack:

        def make(direct: bool = True, **settings: Any) -> Server:
            empty_database(db_url)
            app = create_app(Settings(database_url=db_url, **settings), sweep=False)
            return stack.enter_context(Server(app, direct))

        yield make


@contextmanager
def _held(ingest: Any) -> Iterator[threading.Event]:
    """``ingest.submit`` whose batches are stored as ever but whose outcomes reach the
    waiter only once the gate is set (at the end of the block at the latest)."""
    gate = threading.Event()
    submit, submit_call = ingest.submit, ingest.submit_call

    def held(prepared: Any) -> Future[Any]:
        out: Future[Any] = Future()
        inner = submit(prepared)
        threading.Thread(target=lambda: (gate.wait(10), _copy(inner, out)), daemon=True).start()
        return out

    def held_call(prepared: Any, loop: asyncio.AbstractEventLoop, answer: Any) -> None:
        def later(outcome: Any, error: Any) -> None:
            def hand_on() -> None:
                gate.wait(10)
                with contextlib.suppress(RuntimeError):  # the server's loop closed
                    loop.call_soon_threadsafe(answer, outcome, error)

            threading.Thread(target=hand_on, daemon=True).start()

        submit_call(prepared, loop, later)

    ingest.submit, ingest.submit_call = held, held_call
    try:
        yield gate
    finally:
        gate.set()
        ingest.submit, ingest.submit_call = submit, submit_call


def _copy(inner: Future[Any], out: Future[Any]) -> None:
    try:
        out.set_result(inner.result(10))
    except Exception as exc:
        out.set_exception(exc)


def _answers(server: Server) -> list[tuple[int, list[tuple[str, str]], bytes]]:
    out = []
    with httpx.Client(base_url=server.url) as client:
        assert client.post("/v1/runs", json=SPEC).status_code == 201
        for path, body, headers, _ in REQUESTS:
            r = client.post(path, content=body, headers=headers)
            out.append((r.status_code, _headers(r), r.content))
        for r in _busy(server.app)(client):  # type: ignore[arg-type]
            out.append((r.status_code, _headers(r), r.content))
    return out


def _headers(response: httpx.Response) -> list[tuple[str, str]]:
    """The answer's headers in order, but for the date (the clock's, not the answer's)."""
    return [(k, v) for k, v in response.headers.multi_items() if k != "date"]


def test_the_direct_lane_answers_every_request_as_the_asgi_lane_does(
    serve: Callable[..., Server],
) -> None:
    direct = serve(direct=True, **SETTINGS)
    through_direct = _answers(direct)
    asgi = serve(direct=False, **SETTINGS)
    through_asgi = _answers(asgi)
    labels = [f"{i}: {path}" for i, (path, *_) in enumerate(REQUESTS)] + ["busy", "get"]
    for label, one, other in zip(labels, through_direct, through_asgi, strict=True):
        assert one == other, label
    assert asgi.served == []
    # what the direct lane took: the plain ones of a known run, errors included (bad
    # JSON, a conflict, an unknown metric); not partial=true, gzip, a body over the
    # limit, another type, another query or path, an unknown run, a full budget
    taken = [0, 1, 2, 4, 5, 6, 7, 9, 10, 11, 12, 13]
    assert len(direct.served) == len(taken)
    statuses = [through_direct[i][0] for i in taken]
    assert statuses == [200, 200, 409, 200, 200, 409, 422, 400, 400, 422, 422, 422]


def _count(url: str, status: int) -> float:
    with httpx.Client(base_url=url) as client:
        return _requests_counted(client, status)


def _eventually(read: Callable[[], float], wait_s: float = 5.0) -> float:
    """What ``read`` gives once it is not 0 (or 0 after ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while not (value := read()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


def test_requests_on_one_connection_are_answered_in_order(serve: Callable[..., Server]) -> None:
    """Pipelined: three requests in one write, two for the direct lane and one for
    FastAPI between them; each answered in turn on the one connection."""
    server = serve()
    assert httpx.post(f"{server.url}/v1/runs", json=SPEC).status_code == 201
    first = _rows((0, 0, 0, {"a": 1.5, "n": 2}))
    second = _rows((0, 1, 0, {"a": 2.5, "n": 1}))

    get = b"GET /v1/runs/r HTTP/1.1\r\nHost: t\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_raw(first) + get + _raw(second) + _raw(second))
        answers = _read(sock, 4)
    assert [status for status, _ in answers] == [200, 200, 200, 200]
    assert orjson.loads(answers[0][1])["accepted"] == 1
    assert orjson.loads(answers[1][1])["name"] == "r"
    assert orjson.loads(answers[2][1])["accepted"] == 1
    assert orjson.loads(answers[3][1])["duplicates"] == 1
    assert len(server.served) == 3
    assert _count(server.url, 200) == 3


def _raw(body: bytes, version: str = "HTTP/1.1", extra: str = "") -> bytes:
    """A POST of ``body`` to the run's fragments, as bytes on the wire."""
    head = f"POST /v1/runs/r/fragments {version}\r\nHost: t\r\n{extra}"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def _read(sock: socket.socket, n: int) -> list[tuple[int, bytes]]:
    """``n`` answers with a Content-Length each, as they come."""
    buf, out = b"", []
    sock.settimeout(10)
    while len(out) < n:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            assert chunk, f"closed after {len(out)} answers"
            buf += chunk
        head, buf = buf.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        length = next(
            int(v)
            for k, _, v in (x.partition(b":") for x in lines[1:])
            if k.lower() == b"content-length"
        )
        while len(buf) < length:
            buf += sock.recv(65536)
        out.append((int(lines[0].split()[1]), buf[:length]))
        buf = buf[length:]
    return out


@pytest.mark.parametrize("version", ["HTTP/1.1", "HTTP/1.0"])
def test_an_answer_that_ends_the_connection_says_so(
    serve: Callable[..., Server], version: str
) -> None:
    server = serve()
    assert httpx.post(f"{server.url}/v1/runs", json=SPEC).status_code == 201
    body = _rows((0, 0, 0, {"a": 1.0}))
    close = "Connection: close\r\n" if version == "HTTP/1.1" else ""
    request = _raw(body, version, close)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request)
        sock.settimeout(10)
        data = b""
        while chunk := sock.recv(65536):  # to the end: the server closes the connection
            data += chunk
    assert data.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"\r\nconnection: close\r\n" in data
    assert orjson.loads(data.split(b"\r\n\r\n", 1)[1])["accepted"] == 1
    assert server.served == ["/v1/runs/r/fragments"]


def test_a_batch_whose_client_left_is_stored(serve: Callable[..., Server]) -> None:
    """The client closes its connection before the commit: nothing is written to it,
    and the batch is stored all the same (sent again: duplicates)."""
    server = serve()
    direct = direct_of(server.app)
    assert direct is not None
    assert httpx.post(f"{server.url}/v1/runs", json=SPEC).status_code == 201
    body = _rows((0, 0, 0, {"a": 1.0}))
    with _held(direct.service.ingest):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(_raw(body))
            time.sleep(0.2)
        time.sleep(0.1)
    again = httpx.post(f"{server.url}/v1/runs/r/fragments", content=body, headers=JSON)
    assert again.json() == {"accepted": 0, "duplicates": 1, "commits": 0, "finalised": []}
    assert len(server.served) == 2


def test_past_the_deadline_the_answer_is_503_and_the_batch_is_left_to_its_writer(
    serve: Callable[..., Server],
) -> None:
    answers = []
    for direct in (True, False):
        server = serve(direct=direct, request_timeout_s=0.3)
        app_direct = direct_of(server.app)
        service = server.app.state.service
        # the registration has the same 0.3 s: on a loaded machine it may be answered 503
        # and registered all the same (then the same spec again is 200)
        registered = 0
        for _ in range(20):
            registered = httpx.post(f"{server.url}/v1/runs", json=SPEC).status_code
            if registered != 503:
                break
        assert registered in (200, 201)
        body = _rows((0, 0, 0, {"a": 1.0}))
        with _held(service.ingest):
            late = httpx.post(f"{server.url}/v1/runs/r/fragments", content=body, headers=JSON)
            answers.append((late.status_code, _headers(late), late.content))
            assert late.status_code == 503 and late.headers["retry-after"] == "5"
            assert late.json()["error"]["code"] == "unavailable"
            # counted once the answer is out (as the request metrics do after the app
            # returns): a moment after the client has read it
            assert _eventually(functools.partial(_count, server.url, 503)) == 1
            assert (len(server.served) == 1) is direct and (app_direct is not None)
        deadline = time.monotonic() + 10  # the writer stores it: the same body is a duplicate
        while True:
            again = httpx.post(f"{server.url}/v1/runs/r/fragments", content=body, headers=JSON)
            if again.json().get("duplicates") == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert again.json()["duplicates"] == 1
    assert answers[0] == answers[1]


def test_each_request_in_flight_is_answered_503_at_its_own_deadline(
    serve: Callable[..., Server],
) -> None:
    """One timer serves every request in flight: requests that arrive apart, held, are
    each answered 503 once its own deadline passes (not sooner, not all at the first)."""
    server = serve(request_timeout_s=1.0)
    assert httpx.post(f"{server.url}/v1/runs", json=SPEC, timeout=10).status_code == 201
    bodies = [_rows((0, rank, 0, {"a": 1.0})) for rank in range(2)]
    answered: dict[int, float] = {}

    def post(i: int) -> None:
        r = httpx.post(f"{server.url}/v1/runs/r/fragments", content=bodies[i], headers=JSON)
        assert r.status_code == 503, r.text
        answered[i] = time.monotonic()

    with _held(server.app.state.service.ingest):
        sent = [time.monotonic()]
        first = threading.Thread(target=post, args=(0,))
        first.start()
        time.sleep(0.6)
        sent.append(time.monotonic())
        second = threading.Thread(target=post, args=(1,))
        second.start()
        first.join(10)
        second.join(10)
    assert len(server.served) == 2
    for i in range(2):  # its deadline is its own arrival's second, not the other's
        assert 1.0 <= answered[i] - sent[i] < 2.5, (i, answered[i] - sent[i])


def test_an_unexpected_error_is_500_counted_and_logged(
    serve: Callable[..., Server], caplog: pytest.LogCaptureFixture
) -> None:
    answers = []
    for direct in (True, False):
        server = serve(direct=direct)
        service = server.app.state.service
        assert httpx.post(f"{server.url}/v1/runs", json=SPEC).status_code == 201

        def failing(prepared: Any) -> Future[Any]:
            out: Future[Any] = Future()
            out.set_exception(RuntimeError("boom " * 100))
            return out

        def failing_call(prepared: Any, loop: asyncio.AbstractEventLoop, answer: Any) -> None:
            loop.call_soon(answer, None, RuntimeError("boom " * 100))

        service.ingest.submit, service.ingest.submit_call = failing, failing_call
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            body = _rows((0, 0, 0, {"a": 1.0}))
            r = httpx.post(f"{server.url}/v1/runs/r/fragments", content=body, headers=JSON)
        answers.append((r.status_code, _headers(r), r.content))
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "internal" and "boom" not in r.text
        assert _count(server.url, 500) == 1
        assert any("boom" in str(rec.exc_info and rec.exc_info[1]) for rec in caplog.records)
        assert len(server.served) == int(direct)
    assert answers[0] == answers[1]


def test_the_rate_limit_is_one_bucket_for_both_lanes(serve: Callable[..., Server]) -> None:
    """Both lanes take from the address's bucket; a request that names another address
    (``X-Forwarded-For`` from a trusted proxy) goes the ASGI way, to that address's."""
    server = serve(rate_limit_per_s=0.001, rate_limit_burst=3)
    with httpx.Client(base_url=server.url) as client:
        assert client.post("/v1/runs", json=SPEC).status_code == 201  # 1
        body = _rows((0, 0, 0, {"a": 1.0}))
        assert client.post("/v1/runs/r/fragments", content=body, headers=JSON).status_code == 200
        forwarded = {**JSON, "x-forwarded-for": "10.0.0.9"}  # another bucket
        r = client.post("/v1/runs/r/fragments", content=body, headers=forwarded)
        assert r.status_code == 200 and r.json()["duplicates"] == 1
        assert client.post("/v1/runs/r/fragments", content=body, headers=JSON).status_code == 200
        limited = client.post("/v1/runs/r/fragments", content=body, headers=JSON)  # 4
        assert limited.status_code == 429
        assert limited.json()["error"]["code"] == "rate_limited"
    assert len(server.served) == 2  # the first and the third


def test_with_auth_on_there_is_no_direct_lane(db_url: str) -> None:
    app = create_app(Settings(database_url=db_url, auth="on"), sweep=False)
    assert direct_of(app) is None
    app = create_app(Settings(database_url=db_url), sweep=False)
    assert isinstance(direct_of(app), DirectLane)


def test_steptally_serve_serves_with_the_lane_protocol(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    settings = Settings(database_url=f"sqlite:///{tmp_path}/s.sqlite3")
    assert serving.serve(settings, 1) == 0
    assert seen["http"] is LaneProtocol


def test_a_request_in_flight_at_shutdown_is_answered_then_the_connection_closed(
    serve: Callable[..., Server],
) -> None:
    server = serve()
    service = server.app.state.service
    assert httpx.post(f"{server.url}/v1/runs", json=SPEC).status_code == 201
    with (
        _held(service.ingest) as gate,
        socket.create_connection(("127.0.0.1", server.port)) as sock,
    ):
        sock.sendall(_raw(_rows((0, 0, 0, {"a": 1.0}))))
        time.sleep(0.2)
        server.server.should_exit = True
        time.sleep(0.3)
        assert server.thread.is_alive()  # waiting for the answer
        gate.set()
        sock.settimeout(10)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\nconnection: close\r\n" in data
    assert orjson.loads(data.split(b"\r\n\r\n", 1)[1])["accepted"] == 1
    server.thread.join(10)
    assert not server.thread.is_alive()


def _scope_of(target: bytes, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    """The scope uvicorn's protocol makes of a POST's head (path unquoted)."""
    raw, _, query = target.partition(b"?")
    return {
        "type": "http",
        "method": "POST",
        "http_version": "1.1",
        "root_path": "",
        "path": urllib.parse.unquote(raw.decode("ascii")),
        "raw_path": raw,
        "query_string": query,
        "headers": headers,
        "client": ("127.0.0.1", 40000),
    }


LENGTH = (b"content-length", b"20")
JSON_TYPE = (b"content-type", b"application/json")
HEADS = [
    (b"/v1/runs/r/fragments", [JSON_TYPE, LENGTH]),
    (b"/v1/runs/r/fragments?partial=false", [LENGTH]),
    (b"/v1/runs/run.1_b-2/fragments", [(b"content-type", b"application/x+json"), LENGTH]),
    (b"/v1/runs/r/fragments?partial=true", [JSON_TYPE, LENGTH]),
    (b"/v1/runs/r/fragments?partial=false&x=1", [JSON_TYPE, LENGTH]),
    (b"/v1/runs/r%2Db/fragments", [JSON_TYPE, LENGTH]),
    (b"/v1/runs/-r/fragments", [JSON_TYPE, LENGTH]),
    (b"/v1/runs/r/fragments/", [JSON_TYPE, LENGTH]),
    (b"/v1/runs/r/fragment", [JSON_TYPE, LENGTH]),
    (b"/v1/runs/r/fragments", [(b"content-type", b"text/plain"), LENGTH]),
    (b"/v1/runs/r/fragments", [JSON_TYPE]),
    (b"/v1/runs/r/fragments", [JSON_TYPE, (b"content-length", b"x1")]),
    (b"/v1/runs/r/fragments", [JSON_TYPE, LENGTH, LENGTH]),
    (b"/v1/runs/r/fragments", [JSON_TYPE, (b"content-length", b"99999999999")]),
    (b"/v1/runs/r/fragments", [JSON_TYPE, LENGTH, (b"content-encoding", b"gzip")]),
    (b"/v1/runs/r/fragments", [JSON_TYPE, LENGTH, (b"expect", b"100-continue")]),
    (b"/v1/runs/r/fragments", [JSON_TYPE, LENGTH, (b"transfer-encoding", b"chunked")]),
    (b"/v1/runs/r/fragments", [JSON_TYPE, LENGTH, (b"x-forwarded-for", b"10.0.0.9")]),
]


@pytest.mark.parametrize("limited", [False, True])
def test_the_raw_check_takes_only_what_the_scope_check_takes_and_the_same_run(
    db_url: str, empty_database: Callable[[str], None], limited: bool
) -> None:
    """``DirectLane.lean`` reads the lane's requests from the raw head, where ``takes``
    reads the scope: whatever the first takes the second does, for the same run (what
    the first leaves, uvicorn's way then decides)."""
    empty_database(db_url)
    limit = 10_000.0 if limited else 0.0  # 0: no limit, so no address to read
    direct = direct_of(
        create_app(Settings(database_url=db_url, rate_limit_per_s=limit), sweep=False)
    )
    assert direct is not None
    lean_taken = []
    for target, headers in HEADS:
        scope = _scope_of(target, headers)
        run = direct.lean(target, headers)
        taken = direct.takes(scope)
        if run is not None:
            assert taken and scope["path_params"]["run"] == run, target
            lean_taken.append(target)
    expected = [t for t, _ in HEADS[:3]] + ([] if limited else [HEADS[-1][0]])
    assert lean_taken == expected, lean_taken
