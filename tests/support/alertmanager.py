"""A real Alertmanager (Debian's ``prometheus-alertmanager``) with the stack's own
configuration (``deploy/alertmanager/alertmanager.yml``), its webhook pointed at a
``steptally alert-log`` receiver and its waits shortened to a second; both started
on free ports, stopped by :meth:`close`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from support.served import free_port

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "alertmanager" / "alertmanager.yml"


class Alerting:
    def __init__(self, tmp: Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
        if binary is None:
            pytest.fail("Alertmanager is missing: run scripts/ensure-services.sh")
        self.receiver_port, self.port = free_port(), free_port()
        self.receiver = f"http://127.0.0.1:{self.receiver_port}"
        self.address = f"127.0.0.1:{self.port}"
        config = yaml.safe_load(CONFIG.read_text())
        config["route"].update(group_wait="0s", group_interval="1s")
        (hook,) = config["receivers"][0]["webhook_configs"]
        hook["url"] = f"{self.receiver}/steptally"
        (tmp / "alertmanager.yml").write_text(yaml.safe_dump(config))
        self.log = tmp / "alerting.log"
        with open(self.log, "wb") as log:
            receiver = ["alert-log", "--port", str(self.receiver_port)]
            self.receiver_proc = subprocess.Popen(
                [sys.executable, "-m", "steptally.service.cli", *receiver],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={tmp / 'alertmanager.yml'}",
                    f"--storage.path={tmp / 'alertmanager'}",
                    f"--web.listen-address={self.address}",
                    "--cluster.listen-address=",  # one instance: no gossip port
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._wait(f"{self.receiver}/healthz")
        self._wait(f"http://{self.address}/-/ready")

    def _wait(self, url: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        pytest.fail(f"{url} did not answer:\n{self.log.read_text()[-2000:]}")

    def received(self) -> list[dict[str, Any]]:
        """Every alert the receiver was sent, oldest first."""
        alerts: list[dict[str, Any]] = httpx.get(f"{self.receiver}/alerts").json()
        return alerts

    def wait_for(self, alertname: str, timeout: float = 60.0) -> list[dict[str, Any]]:
        """The alerts named ``alertname`` once the receiver has one."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [a for a in self.received() if a["labels"].get("alertname") == alertname]
            if found:
                return found
            time.sleep(0.25)
        pytest.fail(f"no {alertname} reached the receiver:\n{self.log.read_text()[-3000:]}")

    def close(self) -> None:
        for proc in (self.proc, self.receiver_proc):
            proc.terminate()
        for proc in (self.proc, self.receiver_proc):
            proc.wait(30)
