"""A ``redis-server`` of a test's own (stopped, killed and started again on one port),
and private key prefixes on the shared Redis."""

from __future__ import annotations

import signal
import subprocess
import time
import uuid
from pathlib import Path

import redis

from tests.support.served import free_port

SHARED_REDIS = "redis://127.0.0.1:6379/0"


class PrivateRedis:
    """``redis-server`` on a free port, its files in ``directory``; ``aof`` keeps every
    write in an append-only file synced at each write (``appendfsync always``)."""

    def __init__(self, directory: Path, *, aof: bool = False) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = directory
        self._aof = aof
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--save", "", "--dir", str(self._dir)]
        if self._aof:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        client.close()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)
            self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


def private_prefix() -> str:
    return f"steptally-test-{uuid.uuid4().hex}"


def delete_prefix(url: str, prefix: str) -> None:
    """Delete every key under ``prefix`` (as a wipe of this deployment's Redis)."""
    client = redis.Redis.from_url(url)
    try:
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)
    finally:
        client.close()
