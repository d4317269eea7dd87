"""The alerting rules of ``deploy/prometheus/`` are valid and do what their unit tests
(``rules.test.yml``) say, by Prometheus's own ``promtool``; and Prometheus loads them
from the configuration the compose stack mounts."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian's prometheus)")


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=RULES, capture_output=True, text=True, timeout=120)


def test_every_rule_is_valid_and_passes_its_unit_tests() -> None:
    checked = _promtool("check", "rules", "rules.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 7 rules found" in checked.stdout
    tested = _promtool("test", "rules", "rules.test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    tests = yaml.safe_load((RULES / "rules.test.yml").read_text())["tests"]
    named = {t["alertname"] for group in tests for t in group["alert_rule_test"]}
    rules = yaml.safe_load((RULES / "rules.yml").read_text())["groups"]
    assert named == {r["alert"] for g in rules for r in g["rules"]}  # each one tested


def test_a_rule_that_misses_its_expectation_fails(tmp_path: Path) -> None:
    """The unit tests can fail: the same tests against a rule with another threshold."""
    rules = (RULES / "rules.yml").read_text().replace("> 0.05", "> 0.5")
    (tmp_path / "rules.yml").write_text(rules)
    shutil.copy(RULES / "rules.test.yml", tmp_path)
    assert PROMTOOL is not None
    run = subprocess.run(
        [PROMTOOL, "test", "rules", "rules.test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0 and "SteptallyServerErrors" in run.stdout + run.stderr


def test_prometheus_configuration_loads_the_rules() -> None:
    config = yaml.safe_load((RULES / "prometheus.yml").read_text())
    assert config["rule_files"] == ["rules.yml"]
