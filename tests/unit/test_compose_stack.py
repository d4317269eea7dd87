"""The production stack in docker-compose.yml, checked from the files themselves:
pinned images, a healthcheck on every long-running service, start order, three
replicas sharing one database and one Redis behind the load balancer, Redis with an
append-only file, Prometheus scraping every replica, and auth on with the stack's own
read tokens made by a one-shot service."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
REPLICAS = ["steptally-1", "steptally-2", "steptally-3"]
ONE_SHOT = {"migrate", "tokens"}


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    found: dict[str, Any] = compose["services"]
    return found


def _replicas(services: dict[str, Any]) -> list[str]:
    return sorted(n for n, s in services.items() if "serve" in s.get("command", []))


def test_docker_compose_accepts_the_file() -> None:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed")
    done = subprocess.run(
        ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stderr) == (0, "")


def test_every_image_from_a_registry_is_pinned_to_a_version(services: dict[str, Any]) -> None:
    built = {s["image"] for s in services.values() if "build" in s}  # steptally:local
    pulled = {n: s["image"] for n, s in services.items() if s["image"] not in built}
    assert set(pulled) == {
        "postgres", "redis", "loadbalancer", "prometheus", "alertmanager", "grafana",
    }  # fmt: skip
    for name, image in pulled.items():
        tag = image.rpartition(":")[2]
        assert re.fullmatch(r"v?\d+\.\d+(\.\d+)?(-[a-z]+)?", tag), (name, image)


def test_every_long_running_service_has_a_healthcheck_and_restarts(
    services: dict[str, Any],
) -> None:
    for name, service in services.items():
        if name in ONE_SHOT:
            assert service["restart"] == "no"
            continue
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD" and len(test) > 1, name
        assert service["restart"] == "unless-stopped", name


def test_three_replicas_share_one_database_and_one_redis(services: dict[str, Any]) -> None:
    assert _replicas(services) == REPLICAS
    envs = [services[n]["environment"] for n in REPLICAS]
    assert envs[0] == envs[1] == envs[2] == services["migrate"]["environment"]
    assert envs[0]["STEPTALLY_DATABASE_URL"].split("@")[1] == "postgres:5432/steptally"
    assert envs[0]["STEPTALLY_REDIS_URL"] == "redis://redis:6379/0"
    assert "ports" not in services["steptally-1"]  # reached through the load balancer


def test_start_order_waits_for_what_each_service_needs(services: dict[str, Any]) -> None:
    for name in REPLICAS:
        assert services[name]["depends_on"] == {
            "postgres": {"condition": "service_healthy"},
            "redis": {"condition": "service_healthy"},
            "migrate": {"condition": "service_completed_successfully"},
            "tokens": {"condition": "service_completed_successfully"},
        }
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    done = {"condition": "service_completed_successfully"}
    assert services["tokens"]["depends_on"] == {"migrate": done}
    healthy_replicas = {n: {"condition": "service_healthy"} for n in REPLICAS}
    assert services["loadbalancer"]["depends_on"] == healthy_replicas
    healthy = {"condition": "service_healthy"}
    assert services["prometheus"]["depends_on"] == {**healthy_replicas, "alertmanager": healthy}
    assert services["alertmanager"]["depends_on"] == {"alert-webhook": healthy}
    assert services["alert-webhook"]["command"][:2] == ["steptally", "alert-log"]
    assert services["grafana"]["depends_on"]["prometheus"] == {"condition": "service_healthy"}


def test_redis_keeps_an_append_only_file_on_a_volume(services: dict[str, Any]) -> None:
    command = services["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert services["redis"]["volumes"] == ["redisdata:/data"]


def test_the_load_balancer_sends_to_every_replica() -> None:
    conf = (ROOT / "deploy/nginx/nginx.conf").read_text()
    upstream = re.search(r"upstream steptally \{(.*?)\}", conf, re.S)
    assert upstream is not None
    servers = re.findall(r"server (\S+?):8000", upstream.group(1))
    assert servers == REPLICAS
    assert "proxy_buffering off;" in conf  # event streams pass through at once


def test_prometheus_scrapes_every_replica(services: dict[str, Any]) -> None:
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    (static,) = job["static_configs"]
    assert static["targets"] == [f"{n}:8000" for n in _replicas(services)]
    mount = services["prometheus"]["volumes"][0]
    assert mount.startswith("./deploy/prometheus/prometheus.yml:")


def test_auth_is_on_and_the_stack_makes_its_own_read_tokens(services: dict[str, Any]) -> None:
    env = services["steptally-1"]["environment"]
    assert env["STEPTALLY_AUTH"] == "on"
    tokens = services["tokens"]
    assert tokens["environment"] == env  # the same database
    assert tokens["volumes"] == ["tokens:/run/steptally/tokens"]
    script = tokens["command"][0]
    assert "for who in prometheus healthcheck; do" in script
    assert "steptally token create --scope read" in script
    for name in REPLICAS:
        assert services[name]["volumes"] == ["tokens:/run/steptally/tokens:ro"]
        probe = services[name]["healthcheck"]["test"][3]
        assert "open('/run/steptally/tokens/healthcheck')" in probe
        assert "'Authorization': 'Bearer ' + t" in probe and "/readyz" in probe


def test_prometheus_scrapes_with_its_read_token(services: dict[str, Any]) -> None:
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["authorization"] == {
        "type": "Bearer",
        "credentials_file": "/etc/prometheus/tokens/prometheus",
    }
    assert "tokens:/etc/prometheus/tokens:ro" in services["prometheus"]["volumes"]


def test_prometheus_alerts_through_the_stacks_alertmanager_to_its_webhook(
    services: dict[str, Any],
) -> None:
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    (target,) = config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert target == "alertmanager:9093"
    mount = services["alertmanager"]["volumes"][0]
    assert mount.startswith("./deploy/alertmanager/alertmanager.yml:")
    alerting = yaml.safe_load((ROOT / "deploy/alertmanager/alertmanager.yml").read_text())
    (receiver,) = alerting["receivers"]
    assert receiver["name"] == alerting["route"]["receiver"]
    (hook,) = receiver["webhook_configs"]
    assert hook["url"].startswith("http://alert-webhook:8080/")
    assert "run" in alerting["route"]["group_by"] and "rule" in alerting["route"]["group_by"]


def test_amtool_accepts_the_alertmanager_configuration() -> None:
    amtool = shutil.which("amtool")
    if amtool is None:
        pytest.skip("amtool is not installed (Debian's prometheus-alertmanager)")
    path = ROOT / "deploy/alertmanager/alertmanager.yml"
    done = subprocess.run(
        [amtool, "check-config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout and "1 receivers" in done.stdout
