"""The dashboards as code: committed JSON equals a fresh build, and the deployment
(provisioning and docker-compose.yml) provides what the dashboards reference."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from steptally.service.grafana import build
from steptally.service.grafana.datasource import POSTGRES_UID, PROMETHEUS_UID

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROVISIONING = DEPLOY / "grafana" / "provisioning"


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text("utf-8"))


def _dashboards() -> dict[str, Any]:
    return {name: json.loads(build.render(name)) for name in build.DASHBOARDS}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "steptally.service.cli", "grafana", "build", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_committed_dashboards_equal_a_fresh_build() -> None:
    assert build.stale(DEPLOY / "grafana" / "dashboards") == []
    files = sorted(p.name for p in (DEPLOY / "grafana" / "dashboards").glob("*.json"))
    assert files == ["live.json", "run-diagnostics.json", "service-health.json"]


def test_cli_builds_and_check_catches_a_stale_file(tmp_path: Path) -> None:
    built = _cli("--out", str(tmp_path))
    assert built.returncode == 0, built.stderr
    assert _cli("--out", str(tmp_path), "--check").returncode == 0
    for name in build.DASHBOARDS:
        assert (tmp_path / f"{name}.json").read_text("utf-8") == build.render(name)
    (tmp_path / "live.json").write_text("{}", encoding="utf-8")
    stale = _cli("--out", str(tmp_path), "--check")
    assert stale.returncode == 1
    assert "live.json differs from a fresh build" in stale.stderr


def test_every_dashboard_has_unique_panel_ids_and_the_variables() -> None:
    boards = _dashboards()
    assert {b["uid"] for b in boards.values()} == {
        "steptally-run-diagnostics",
        "steptally-live",
        "steptally-service-health",
    }
    for name, board in boards.items():
        ids = [p["id"] for p in board["panels"]]
        assert ids == list(range(1, len(ids) + 1)), name
        names = [v["name"] for v in board["templating"]["list"]]
        assert "run" in names, name
        for var in board["templating"]["list"]:
            if var["type"] == "query":
                assert var["datasource"]["uid"] in (PROMETHEUS_UID, POSTGRES_UID)
    assert {"run", "metric"} <= {v["name"] for v in boards["live"]["templating"]["list"]}
    diagnostics = boards["run-diagnostics"]
    assert {"run", "metric"} <= {v["name"] for v in diagnostics["templating"]["list"]}
    trend = [p for p in diagnostics["panels"] if p["type"] == "trend"]
    assert [p["options"]["xField"] for p in trend] == ["step"]


def test_provisioned_datasources_are_the_ones_the_dashboards_reference() -> None:
    (datasources,) = [_yaml(p) for p in (PROVISIONING / "datasources").glob("*.yaml")]
    provisioned = {d["uid"]: d["type"] for d in datasources["datasources"]}
    referenced = {
        (t["datasource"]["uid"], t["datasource"]["type"])
        for board in _dashboards().values()
        for panel in board["panels"]
        for t in panel.get("targets", [])
    }
    assert referenced == {
        (PROMETHEUS_UID, "prometheus"),
        (POSTGRES_UID, "grafana-postgresql-datasource"),
    }
    assert all(provisioned[uid] == kind for uid, kind in referenced)


def test_compose_runs_grafana_provisioned_from_deploy() -> None:
    compose = _yaml(ROOT / "docker-compose.yml")
    services = compose["services"]
    grafana = services["grafana"]
    image, tag = grafana["image"].split(":")
    assert image == "grafana/grafana" and tag.split(".")[0] == "11" and tag.count(".") == 2
    assert "3000:3000" in grafana["ports"]
    mounts = {m.split(":")[0]: m.split(":")[1] for m in grafana["volumes"]}
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    (provider,) = _yaml(PROVISIONING / "dashboards" / "steptally.yaml")["providers"]
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    (datasources,) = [_yaml(p) for p in (PROVISIONING / "datasources").glob("*.yaml")]
    hosts = {d["url"].removeprefix("http://").split(":")[0] for d in datasources["datasources"]}
    assert hosts == {"prometheus", "postgres"} and hosts <= set(services)
    prometheus = _yaml(DEPLOY / "prometheus" / "prometheus.yml")
    (job,) = prometheus["scrape_configs"]
    replicas = ["steptally-1:8000", "steptally-2:8000", "steptally-3:8000"]
    assert job["static_configs"][0]["targets"] == replicas
    config = "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro"
    assert config in services["prometheus"]["volumes"]


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_compose_file_is_valid() -> None:
    checked = subprocess.run(
        ["docker-compose", "config", "-q"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stderr
