"""``bench/loadgen.py``'s client processes against a real HTTP server: every request
answered, and the clients kept on the cores they are given."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import procstat
from loadgen import Job, blast, request


class _Ok(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the clients expect

    def do_GET(self) -> None:
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _jobs(port: int, clients: int, n: int) -> list[Job]:
    return [Job(port, [request("GET", port, "/healthz")] * n) for _ in range(clients)]


def test_the_clients_run_where_the_kernel_puts_them_by_default(port: int) -> None:
    done = blast(_jobs(port, 2, 5))
    assert done.done == 10 and not done.errors
    assert done.cores == os.sched_getaffinity(0)


def test_the_machine_counter_is_read_when_the_last_client_ends(port: int) -> None:
    before = procstat.machine_busy_s()
    done = blast(_jobs(port, 3, 50))
    after = procstat.machine_busy_s()
    last = max(done.sent, key=lambda s: s.ended)
    assert done.machine_busy_end_s == last.machine_busy_s
    assert before <= done.machine_busy_end_s <= after
    assert all(s.machine_busy_s > 0 for s in done.sent)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell apart")
def test_the_clients_stay_on_the_cores_they_are_given_and_this_process_does_not(
    port: int,
) -> None:
    mine = os.sched_getaffinity(0)
    last = max(mine)
    done = blast(_jobs(port, 3, 5), cpus=str(last))
    assert done.done == 15 and not done.errors
    assert done.cores == {last}
    assert os.sched_getaffinity(0) == mine  # this process is back where it was
