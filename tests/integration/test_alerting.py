"""A KL spike in one step reaches a person: a real ``steptally serve`` checks the run's
alert rule as the step finalises, a real Prometheus scraping it every second evaluates
the stack's own rules (``deploy/prometheus/rules.yml``) and sends the alert to a real
Alertmanager with the stack's configuration, whose webhook is ``steptally alert-log``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.alertmanager import Alerting
from support.prometheus import Prometheus
from support.served import ServedService

pytestmark = [pytest.mark.prometheus, pytest.mark.postgres, pytest.mark.slow]

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "rules.yml"
SPEC = {
    "name": "spiky",
    "world_size": 2,
    "metrics": {"kl_num": "sum", "tokens": "count"},
    "derived": {"kl": "kl_num / tokens"},
    "alerts": [{"name": "kl_spike", "metric": "kl", "above": 0.5}],
}


def _step(url: str, step: int, kl: float, ranks: tuple[int, ...] = (0, 1)) -> None:
    body = {
        "fragments": [
            {"step": step, "rank": r, "seq": 0, "values": {"kl_num": kl * 4, "tokens": 4}}
            for r in ranks
        ],
        "commits": [{"step": step, "rank": r, "fragments": 1} for r in ranks],
    }
    sent = httpx.post(f"{url}/v1/runs/spiky/fragments", json=body)
    assert sent.status_code == 200, sent.text


@pytest.fixture
def stack(
    postgres_url: str,
    empty_database: Callable[[str], None],
    serve: Callable[..., ServedService],
    tmp_path: Path,
) -> Iterator[tuple[ServedService, Prometheus, Alerting]]:
    empty_database(postgres_url)
    service = serve(postgres_url)
    alerting = Alerting(tmp_path / "alerting")
    prometheus = Prometheus(
        f"127.0.0.1:{service.port}", tmp_path, rules=RULES, alertmanager=alerting.address
    )
    try:
        yield service, prometheus, alerting
    finally:
        prometheus.close()
        alerting.close()


def test_a_one_step_kl_spike_reaches_the_webhook_once(
    stack: tuple[ServedService, Prometheus, Alerting],
) -> None:
    service, prometheus, alerting = stack
    assert httpx.post(f"{service.url}/v1/runs", json=SPEC).status_code == 201
    for step in range(3):
        _step(service.url, step, 0.125)
    # the rule's counter is exported from 0, so increase() sees the first breach
    counted = 'count_over_time(steptally_alert_breaches_total{run="spiky", rule="kl_spike"}[1m])'
    prometheus.query(f"{counted} >= 2")
    assert prometheus.value('steptally_alert_breaches_total{rule="kl_spike"}') == 0.0

    _step(service.url, 3, 0.875)  # one step over 0.5, then back to normal at once
    for step in range(4, 6):
        _step(service.url, step, 0.125)
    assert httpx.get(f"{service.url}/v1/runs/spiky/steps/3").json()["breaches"] == [
        {"rule": "kl_spike", "condition": "above", "metric": "kl", "value": 0.875, "threshold": 0.5}
    ]

    (alert, *more) = alerting.wait_for("SteptallyAlertBreach")
    assert alert["status"] == "firing"
    assert alert["labels"] == {
        "alertname": "SteptallyAlertBreach",
        "run": "spiky",
        "rule": "kl_spike",
        "severity": "warning",
    }
    assert alert["annotations"]["summary"] == "run spiky: alert rule kl_spike broken"
    assert "GET /v1/runs/spiky/breaches" in alert["annotations"]["description"]
    assert more == [] or all(a["labels"] == alert["labels"] for a in more)
    assert prometheus.value('max by (rule) (steptally_alert_breaches_total{run="spiky"})') == 1.0


def test_an_open_step_shows_its_missing_ranks_and_age(
    stack: tuple[ServedService, Prometheus, Alerting],
) -> None:
    service, prometheus, _ = stack
    assert httpx.post(f"{service.url}/v1/runs", json={**SPEC, "alerts": []}).status_code == 201
    _step(service.url, 0, 0.125)
    _step(service.url, 1, 0.125, ranks=(0,))  # rank 1 has not committed step 1
    missing = 'steptally_oldest_open_step_missing_ranks{run="spiky"}'
    assert prometheus.value(missing) == 1.0
    age: list[dict[str, Any]] = prometheus.query(
        'steptally_oldest_open_step_age_seconds{run="spiky"} > 0'
    )
    assert float(age[0]["value"][1]) < 300
    _step(service.url, 1, 0.125, ranks=(1,))  # complete: no open step left
    prometheus.query(f"absent({missing})")
