"""Every PromQL expression of the built dashboards, against a real Prometheus
scraping a real ``steptally serve`` with seeded data: each returns data.

The service holds one run with a complete step, a duplicate, a rejected
(conflicting) batch and a partial step that breaks an alert rule, so every series a
panel reads exists.
The template variables take the seeded run and two of its metrics; Grafana's
``$__rate_interval`` becomes 15 s (the scrape interval is 1 s).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import grafana
from support.prometheus import Prometheus
from support.served import ServedService

pytestmark = [pytest.mark.prometheus, pytest.mark.postgres, pytest.mark.slow]

SPEC = {
    "name": "grpo",
    "world_size": 2,
    "step_timeout_s": 1.0,
    "metrics": {"num": "sum", "tokens": "count"},
    "derived": {"mean": "num / tokens"},
    "alerts": [{"name": "mean_high", "metric": "mean", "above": 3.0}],
}
VALUES = {"run": ["grpo"], "metric": ["mean", "num"]}


def _post(base: str, body: dict[str, Any], expect: int = 200) -> None:
    response = httpx.post(f"{base}/v1/runs/grpo/fragments", json=body)
    assert response.status_code == expect, response.text


def _fragment(step: int, rank: int, num: float, tokens: int) -> dict[str, Any]:
    return {"step": step, "rank": rank, "seq": 0, "values": {"num": num, "tokens": tokens}}


def _seed(base: str) -> None:
    assert httpx.post(f"{base}/v1/runs", json=SPEC).status_code == 201
    step0 = [_fragment(0, 0, 1.5, 2), _fragment(0, 1, 2.5, 2)]
    commits = [{"step": 0, "rank": r, "fragments": 1} for r in (0, 1)]
    _post(base, {"fragments": step0, "commits": commits})
    _post(base, {"fragments": step0[:1], "commits": []})  # a duplicate
    _post(base, {"fragments": [_fragment(0, 0, 9.0, 2)], "commits": []}, expect=409)
    _post(base, {"fragments": [_fragment(1, 0, 4.0, 1)], "commits": [commits[0] | {"step": 1}]})
    assert httpx.get(f"{base}/v1/runs/grpo/steps/9").status_code == 404


@pytest.fixture
def seeded(
    postgres_url: str,
    empty_database: Callable[[str], None],
    serve: Callable[..., ServedService],
    tmp_path: Path,
) -> Iterator[Prometheus]:
    empty_database(postgres_url)
    service = serve(postgres_url)
    _seed(service.url)
    prometheus = Prometheus(f"127.0.0.1:{service.port}", tmp_path)
    try:
        # the sweeper finalises step 1 as partial after its timeout
        assert prometheus.value('steptally_partial_steps{run="grpo"} == 1') == 1.0
        yield prometheus
    finally:
        prometheus.close()


def test_dashboard_queries_against_a_real_scrape(seeded: Prometheus) -> None:
    """One service and one Prometheus for the three checks (each start takes seconds)."""
    _every_expression_returns_data(seeded)
    _latest_values_and_backlog_are_exact(seeded)
    _variable_queries_list_the_seeded_run_and_metrics(seeded)


def _every_expression_returns_data(seeded: Prometheus) -> None:
    expressions = list(grafana.targets(grafana.PROMETHEUS))
    assert {name for name, *_ in expressions} == {"live", "service-health"}
    assert len(expressions) >= 15
    for name, title, target, _ in expressions:
        expr = grafana.promql(target["expr"], VALUES)
        assert seeded.query(expr), f"{name} / {title}: {expr}"


def _latest_values_and_backlog_are_exact(seeded: Prometheus) -> None:
    (values,) = [
        t for _, title, t, _ in grafana.targets(grafana.PROMETHEUS) if title == "Latest values"
    ]
    expr = grafana.promql(values["expr"], VALUES)
    # one series per run and metric however many replicas expose it
    selector = 'steptally_metric_value{run=~"grpo", metric=~"(mean|num)"}'
    assert expr == f"max by (run, metric) ({selector})"
    # step 1 (num 4, tokens 1) is the latest finalised step
    got = {s["metric"]["metric"]: float(s["value"][1]) for s in seeded.query(expr)}
    assert got == {"mean": 4.0, "num": 4.0}
    assert seeded.value('steptally_missing_ranks{run=~"grpo"}') == 1.0
    rejected = 'sum by (code) (steptally_requests_rejected_total{code="fragment_conflict"})'
    assert seeded.value(rejected) == 1.0
    errors = 'steptally_http_request_duration_seconds_count{status=~"4..|5.."}'
    # the partial step 1's mean (4) broke mean_high: one breach, whatever the replicas
    breaches = "max by (run, rule) (steptally_alert_breaches_total)"
    assert seeded.value(breaches) == 1.0
    routes = {(s["metric"]["route"], s["metric"]["status"]) for s in seeded.query(errors)}
    assert routes == {("/v1/runs/{run}/fragments", "409"), ("/v1/runs/{run}/steps/{step}", "404")}


def _variable_queries_list_the_seeded_run_and_metrics(seeded: Prometheus) -> None:
    listed = {}
    for name, variable, _ in grafana.query_variables(grafana.PROMETHEUS):
        query = grafana.promql(variable["query"], {"run": ["grpo"]})
        inner = query.removeprefix("label_values(").removesuffix(")")
        selector, label = (part.strip() for part in inner.rsplit(",", 1))
        listed[name, variable["name"]] = seeded.label_values(label, selector)
    assert listed == {
        ("live", "run"): ["grpo"],
        ("live", "metric"): ["mean", "num", "tokens"],
        ("service-health", "run"): ["grpo"],
    }
