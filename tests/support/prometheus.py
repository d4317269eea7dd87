"""A real ``prometheus`` (Debian's package) scraping one target every second.

Started on a free port with its own storage under a temporary folder; queried
through its HTTP API. ``query`` polls until an instant query returns data, since
the first scrapes take a moment.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.served import free_port


class Prometheus:
    def __init__(
        self,
        target: str,
        tmp: Path,
        token: str | None = None,
        rules: Path | None = None,
        alertmanager: str | None = None,
    ) -> None:
        """``token``: scrape with this bearer token (a read token, for auth on);
        ``rules``: a rule file, evaluated every second; ``alertmanager``: where firing
        alerts go (host:port)."""
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("the prometheus binary is missing: run scripts/ensure-services.sh")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp / "prometheus.yml"
        auth = ""
        if token is not None:
            (tmp / "token").write_text(token + "\n")
            auth = (
                f"    authorization:\n      type: Bearer\n      credentials_file: {tmp / 'token'}\n"
            )
        alerting = ""
        if rules is not None:
            alerting += f"rule_files: ['{rules}']\n"
        if alertmanager is not None:
            alerting += (
                "alerting:\n  alertmanagers:\n    - static_configs:\n"
                f"        - targets: ['{alertmanager}']\n"
            )
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
            f"{alerting}"
            "scrape_configs:\n  - job_name: steptally\n"
            f"{auth}    static_configs:\n      - targets: ['{target}']\n"
        )
        self.log = tmp / "prometheus.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def query(self, promql: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Poll an instant query until it returns a non-empty vector."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                body = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}).json()
                if body["status"] == "success" and body["data"]["result"]:
                    return list(body["data"]["result"])
                if body["status"] == "error":
                    pytest.fail(f"Prometheus rejected {promql}: {body['error']}")
            except (httpx.TransportError, ValueError):  # not up yet
                pass
            time.sleep(0.25)
        pytest.fail(f"Prometheus returned nothing for {promql}:\n{self.log.read_text()[-2000:]}")

    def value(self, promql: str) -> float:
        (sample,) = self.query(promql)
        return float(sample["value"][1])

    def label_values(self, label: str, selector: str) -> list[str]:
        """What Grafana's ``label_values(selector, label)`` lists."""
        params = {"match[]": selector}
        body = httpx.get(f"{self.url}/api/v1/label/{label}/values", params=params).json()
        assert body["status"] == "success", body
        return list(body["data"])

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
