"""A cheap load generator: prepared requests, separate client processes, keep-alive.

Every request is built whole (request line, headers and body, as bytes) before the
clock starts; :func:`blast` forks one process per client, each with one keep-alive
connection of its own, and each sends its list of requests one after another with
``socket.sendall`` and reads the answer with a minimal HTTP/1.1 parser (status line,
``Content-Length`` or chunked). No HTTP library runs on the timed path, so a request
costs the client a few tens of microseconds of CPU, which each client measures
(``getrusage``) and returns with its timings.

:func:`listen` follows a run's event stream (``GET /v1/runs/{run}/events``) in a
process of its own and stamps each ``step`` event with ``time.monotonic()`` when it
arrives: on Linux the monotonic clock is one clock for every process of the machine,
so its stamps compare with the clients' answer times.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import resource
import socket
import time
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event as EventType
from typing import Any

import httpx
import orjson
import procstat

from steptally.service.settings import cpu_list

FORK = mp.get_context("fork")


def request(method: str, port: int, path: str, body: bytes = b"", kind: str = "json") -> bytes:
    """One whole HTTP/1.1 request (keep-alive) to 127.0.0.1:``port``."""
    ctype = "application/json" if kind == "json" else "text/plain; version=0.0.4"
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
    if body or method in ("POST", "PUT"):
        head += f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
    return (head + "\r\n").encode() + body


class Connection:
    """One keep-alive connection that sends prepared requests and reads the answers."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reconnects = 0
        self._sock = self._connect()
        self._buf = bytearray()

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def close(self) -> None:
        self._sock.close()

    def roundtrip(self, req: bytes) -> tuple[int, bytes]:
        """Send ``req`` and return the answer's status and body. A connection the
        server closed while idle (its keep-alive timeout) is opened again once."""
        try:
            self._sock.sendall(req)
            return self._answer()
        except (ConnectionError, EOFError):
            self.reconnects += 1
            self._sock.close()
            self._sock, self._buf = self._connect(), bytearray()
            self._sock.sendall(req)
            return self._answer()

    def _fill(self) -> None:
        chunk = self._sock.recv(1 << 16)
        if not chunk:
            raise EOFError("the server closed the connection")
        self._buf += chunk

    def _take(self, n: int) -> bytes:
        while len(self._buf) < n:
            self._fill()
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def _line(self) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            self._fill()
        return self._take(end + 2)[:-2]

    def _answer(self) -> tuple[int, bytes]:
        while (end := self._buf.find(b"\r\n\r\n")) < 0:
            self._fill()
        head = self._take(end + 4).decode("latin-1").split("\r\n")
        status = int(head[0].split(" ", 2)[1])
        headers = {}
        for line in head[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            return status, self._take(int(headers["content-length"]))
        if headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while size := int(self._line().split(b";")[0], 16):
                parts.append(self._take(size))
                self._take(2)
            while self._line():  # trailers, up to the empty line
                pass
            return status, b"".join(parts)
        return status, b""


@dataclass
class Job:
    """What one client sends: ``requests`` in order to ``port``; ``steps[i]`` tags
    request i (the step it carries, or -1) and ``answers`` keeps the answers' bodies
    (ingest answers name the steps they finalised); ``deadline_s`` stops sending once
    that long has passed since the start (the answer of a request in flight is kept)."""

    port: int
    requests: list[bytes]
    steps: list[int] = field(default_factory=list)
    answers: bool = False
    deadline_s: float | None = None
    warmup: list[bytes] = field(default_factory=list)


@dataclass
class Sent:
    """What one client measured."""

    started: float  # monotonic, after the start barrier
    ended: float
    cpu_s: float  # user + system of the client process while it sent
    done: int  # requests answered
    reconnects: int
    steps: list[int]  # per answered request: its tag
    sent_at: list[float]  # monotonic
    answered_at: list[float]
    finalised: list[list[int]]  # per answered request: the steps its answer finalised
    errors: list[str]
    cores: set[int] = field(default_factory=set)  # the cores the client could run on
    machine_busy_s: float = 0.0  # procstat.machine_busy_s() when the client ended


def _client(job: Job, barrier: Any, out: Any) -> None:
    conn = Connection(job.port)
    errors: list[str] = []
    for req in job.warmup:
        status, body = conn.roundtrip(req)
        if status >= 300:
            errors.append(f"warm-up {status}: {body[:200]!r}")
    barrier.wait()
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    started = time.monotonic()
    stop = started + job.deadline_s if job.deadline_s is not None else float("inf")
    sent_at: list[float] = []
    answered_at: list[float] = []
    finalised: list[list[int]] = []
    for req in job.requests:
        t = time.monotonic()
        if t > stop:
            break
        status, body = conn.roundtrip(req)
        answered_at.append(time.monotonic())
        sent_at.append(t)
        if status >= 300:
            errors.append(f"{status}: {body[:200]!r}")
        elif job.answers:
            finalised.append([f["step"] for f in orjson.loads(body)["finalised"]])
    ended = time.monotonic()
    machine = procstat.machine_busy_s()
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    done = len(answered_at)
    out.put(
        Sent(
            started,
            ended,
            cpu,
            done,
            conn.reconnects,
            job.steps[:done],
            sent_at,
            answered_at,
            finalised,
            errors,
            os.sched_getaffinity(0),
            machine,
        )
    )
    conn.close()


@dataclass
class Blast:
    """The clients' results together."""

    sent: list[Sent]

    @property
    def elapsed_s(self) -> float:
        return max(s.ended for s in self.sent) - min(s.started for s in self.sent)

    @property
    def done(self) -> int:
        return sum(s.done for s in self.sent)

    @property
    def cpu_s(self) -> float:
        return sum(s.cpu_s for s in self.sent)

    @property
    def errors(self) -> list[str]:
        return [e for s in self.sent for e in s.errors]

    @property
    def machine_busy_end_s(self) -> float:
        """The machine's busy CPU seconds (:func:`procstat.machine_busy_s`) when the last
        client ended: a window's end that leaves out the clients' exit and the hand-over
        of their timings to this process, which for a window of a few tenths of a second
        made the machine look more than 100 % busy."""
        return max(self.sent, key=lambda s: s.ended).machine_busy_s

    @property
    def cores(self) -> set[int]:
        """Every core a client could run on."""
        return set().union(*(s.cores for s in self.sent))


def blast(
    jobs: list[Job], on_start: Any = None, timeout_s: float = 3600, cpus: str | None = None
) -> Blast:
    """Run every job in a client process of its own, all released at once; ``on_start``
    is called in this process just before the release (to read CPU counters). ``cpus``
    (a Linux CPU list, as ``steptally serve --cpus`` takes): the cores the client
    processes run on, so that they stay off a server's (None: where the kernel puts
    them); they are forked from this process, which is kept there while it forks them."""
    barrier = FORK.Barrier(len(jobs) + 1)
    out = FORK.Queue()
    procs = [FORK.Process(target=_client, args=(job, barrier, out)) for job in jobs]
    mine = os.sched_getaffinity(0)
    # the clients are forked: their garbage collector would walk every object they
    # inherit (this process's bodies, earlier rows), copying each page it touches and
    # charging the client for it, more the more this process holds (bench/README.md,
    # Scale: the configuration run second paid 2-5x the CPU a request)
    gc.freeze()
    try:
        if cpus is not None:
            os.sched_setaffinity(0, cpu_list(cpus))
        for p in procs:
            p.start()
    finally:
        gc.unfreeze()
        os.sched_setaffinity(0, mine)
    # every client is connected and warm once all of them wait at the barrier
    deadline = time.monotonic() + timeout_s
    while barrier.n_waiting < len(jobs):
        if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise RuntimeError("a client process failed before the start")
        time.sleep(0.005)
    if on_start is not None:
        on_start()
    barrier.wait(timeout=timeout_s)
    sent: list[Sent] = []
    while len(sent) < len(jobs):
        try:
            sent.append(out.get(timeout=1.0))
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline + timeout_s:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"client processes failed (exit {failed})") from None
    for p in procs:
        p.join(timeout=30)
    return Blast(sent)


def _listen(url: str, ready: EventType, out: Any) -> None:
    timeout = httpx.Timeout(10.0, read=None)
    with httpx.Client(timeout=timeout) as client, client.stream("GET", url) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if line.startswith(": live"):
                ready.set()
            elif line.startswith("data:"):
                step = orjson.loads(line[5:])
                out.put((step["step"], step["status"], step["revision"], time.monotonic()))


class Listener:
    """A process following ``GET {base}/v1/runs/{run}/events`` from now on."""

    def __init__(self, base: str, run: str) -> None:
        self._ready = FORK.Event()
        self._out: Any = FORK.Queue()
        url = f"{base}/v1/runs/{run}/events"
        self._proc = FORK.Process(target=_listen, args=(url, self._ready, self._out))
        self._proc.start()
        if not self._ready.wait(30):
            self._proc.kill()
            raise RuntimeError(f"the event stream {url} did not open")
        self.seen: list[tuple[int, str, int, float]] = []

    def wait_for(self, steps: set[int], timeout_s: float) -> list[tuple[int, str, int, float]]:
        """Collect events until every step of ``steps`` was seen (or the timeout)."""
        deadline = time.monotonic() + timeout_s
        missing = set(steps) - {s for s, *_ in self.seen}
        while missing and time.monotonic() < deadline:
            try:
                event = self._out.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.seen.append(event)
            missing.discard(event[0])
        return self.seen

    def close(self) -> None:
        self._proc.kill()
        self._proc.join(10)
