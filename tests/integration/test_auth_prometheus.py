"""A real Prometheus scrapes ``steptally serve`` with auth on: with a read token (its
``credentials_file``, as deploy/prometheus/prometheus.yml does) the target is up and
the run's values arrive; without one the scrape is refused (401) and the target down."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from support.prometheus import Prometheus
from support.served import ServedService

pytestmark = pytest.mark.prometheus


def test_prometheus_scrapes_with_a_read_token(tmp_path: Path) -> None:
    service = ServedService(f"sqlite:///{tmp_path / 'db.sqlite3'}", tmp_path / "service.log")

    def token(*args: str) -> str:
        done = service.cli("token", "create", "--database-url", service.database_url, *args)
        return done.stdout.decode().splitlines()[-1]

    read, admin = token("--scope", "read"), token("--scope", "admin")
    service.env, service.ready_token = {"STEPTALLY_AUTH": "on"}, read
    service.start()
    scrapers: list[Prometheus] = []
    try:
        h = {"Authorization": f"Bearer {admin}"}
        spec = {"name": "scraped", "world_size": 1, "metrics": {"a": "sum"}}
        assert httpx.post(f"{service.url}/v1/runs", json=spec, headers=h).status_code == 201
        batch = {
            "fragments": [{"step": 0, "rank": 0, "seq": 0, "values": {"a": 2.25}}],
            "commits": [{"step": 0, "rank": 0, "fragments": 1}],
        }
        posted = httpx.post(f"{service.url}/v1/runs/scraped/fragments", json=batch, headers=h)
        assert posted.status_code == 200
        target = f"127.0.0.1:{service.port}"
        for name, secret in (("with", read), ("without", None)):
            (tmp_path / name).mkdir()
            scrapers.append(Prometheus(target, tmp_path / name, token=secret))
        with_token, without = scrapers
        assert with_token.value('up{job="steptally"}') == 1.0
        (sample,) = with_token.query('{__name__=~"steptally_.*", run="scraped", metric="a"}')
        assert float(sample["value"][1]) == 2.25
        assert without.value('up{job="steptally"}') == 0.0
        targets = httpx.get(f"{without.url}/api/v1/targets").json()["data"]["activeTargets"]
        assert "401" in targets[0]["lastError"]
    finally:
        for p in scrapers:
            p.close()
        service.stop()
