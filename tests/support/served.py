"""``steptally serve`` as a real subprocess, for tests that need a running service."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServedService:
    """``steptally serve`` as a real subprocess on a fixed port and database, to start,
    kill (any signal) and start again."""

    def __init__(self, database_url: str, log: Path, *, migrate: bool = True) -> None:
        self.database_url = database_url
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}  # more environment for the service (STEPTALLY_AUTH=on)
        self.ready_token: str | None = None  # a read token for /readyz, with auth on
        if migrate:
            self.cli("migrate", "--database-url", database_url)

    @staticmethod
    def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "steptally.service.cli", *args],
            check=check,
            capture_output=True,
            timeout=120,
        )

    def start(self, *extra: str) -> ServedService:
        args = ["--database-url", self.database_url, "--host", "127.0.0.1"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "steptally.service.cli",
                    "serve",
                    *args,
                    "--port",
                    str(self.port),
                    *extra,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
            )
        deadline = time.monotonic() + 30
        while True:
            try:
                auth = {"Authorization": f"Bearer {self.ready_token}"} if self.ready_token else {}
                if httpx.get(f"{self.url}/readyz", headers=auth).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop(signal.SIGKILL)
                pytest.fail(f"steptally serve did not start:\n{self.log.read_text()}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            self.proc.wait(timeout=30)
        self.proc = None
