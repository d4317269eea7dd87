"""Restart: a new app over the same database, and ``kill -9`` of a real server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

Api = Any  # the `api` fixture of conftest.py


def test_second_app_over_same_database_answers_identically(
    api: Api, make_client: Any, api_of: Any
) -> None:
    api.register(world_size=2, derived={"mean": "a / n"})
    api.send([(0, 0, 0, {"a": 1e17, "n": 1}), (0, 1, 0, {"a": 1.0, "n": 2})], [(0, 0, 1)])
    api.send([(1, 0, 0, {"a": 0.1, "n": 3})], [(1, 0, 1), (1, 1, 0)])
    before = [api.step(0), api.step(1), api.client.get("/v1/runs").json()]
    _, other_client = make_client()
    other = api_of(other_client)
    assert [other.step(0), other.step(1), other.client.get("/v1/runs").json()] == before
    other.send([(0, 1, 1, {"a": -1e17, "n": 1})], [(0, 1, 2)])
    assert api.value(0, "a") == 1.0
    assert api.value(0, "mean") == 0.25


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(url: str, port: int) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "steptally.service.cli",
        "serve",
        "--database-url",
        url,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"steptally serve did not start: {err.decode()}")
        time.sleep(0.05)


def _stop(proc: subprocess.Popen[bytes], sig: int) -> None:
    os.kill(proc.pid, sig)
    proc.communicate(timeout=30)


@pytest.mark.slow
def test_kill_9_loses_nothing_acknowledged(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'served.sqlite3'}"
    exe = [sys.executable, "-m", "steptally.service.cli"]
    refused = subprocess.run([*exe, "serve", "--database-url", url], capture_output=True)
    assert refused.returncode != 0
    assert b"steptally migrate" in refused.stderr
    subprocess.run([*exe, "migrate", "--database-url", url], check=True, capture_output=True)
    port = _free_port()
    base = f"http://127.0.0.1:{port}/v1/runs"
    proc = _serve(url, port)
    try:
        spec = {
            "name": "k",
            "world_size": 3,
            "metrics": {"a": "sum", "n": "count"},
            "derived": {"mean": "a / n"},
        }
        assert httpx.post(base, json=spec).status_code == 201
        for rank, a in enumerate([1e17, 1.0]):
            body = {
                "fragments": [
                    {"step": 0, "rank": rank, "seq": 0, "values": {"a": a, "n": rank + 1}}
                ],
                "commits": [{"step": 0, "rank": rank, "fragments": 1}],
            }
            assert httpx.post(f"{base}/k/fragments", json=body).status_code == 200
    finally:
        _stop(proc, signal.SIGKILL)
    proc = _serve(url, port)
    try:
        body = {
            "fragments": [{"step": 0, "rank": 2, "seq": 0, "values": {"a": -1e17, "n": 1}}],
            "commits": [{"step": 0, "rank": 2, "fragments": 1}],
        }
        answer = httpx.post(f"{base}/k/fragments", json=body).json()
        assert answer["finalised"] == [{"step": 0, "status": "complete", "revision": 1}]
        step = httpx.get(f"{base}/k/steps/0").json()
        assert step["metrics"]["a"]["value"] == 1.0
        assert step["metrics"]["mean"]["value"] == 0.25
        assert step["fragments"] == {"received": 3, "expected": 3}
    finally:
        _stop(proc, signal.SIGTERM)
