"""Exposition: exact values through a real Prometheus scrape, and the collector itself.

A real ``prometheus`` (Debian's package) scrapes a real ``steptally serve`` every
second; the values are read back with PromQL through Prometheus's HTTP API and must
equal, bit for bit, what the REST API reports and what the exact algebra gives.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.prometheus import Prometheus

pytestmark = [pytest.mark.prometheus]

SPEC = {
    "name": "grpo",
    "world_size": 3,
    "step_timeout_s": 1.0,
    "metrics": {"num": "sum", "tokens": "count", "peak": "max", "bad": "sum"},
    "derived": {"mean": "num / tokens"},
}
# num = 1e17 + 0.1 - 1e17 exactly, tokens = 3 + 4 + 0
STEP0 = [
    (0, {"num": 1e17, "tokens": 3, "peak": 1.5, "bad": 1.0}),
    (1, {"num": 0.1, "tokens": 4, "peak": 2.25, "bad": "NaN"}),
    (2, {"num": -1e17, "tokens": 0}),
]


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[str], Prometheus]]:
    started: list[Prometheus] = []

    def start(target: str) -> Prometheus:
        started.append(Prometheus(target, tmp_path))
        return started[-1]

    yield start
    for p in started:
        p.close()


def _post(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{base}{path}", json=body)
    assert response.is_success, response.text
    result: dict[str, Any] = response.json()
    return result


def test_exact_values_survive_a_real_scrape(
    db_url: str, serve: Callable[..., Any], prometheus: Callable[[str], Prometheus]
) -> None:
    service = serve(db_url)
    base = service.url
    _post(base, "/v1/runs", SPEC)
    frags = [{"step": 0, "rank": r, "seq": 0, "values": v} for r, v in STEP0]
    commits = [{"step": 0, "rank": r, "fragments": 1} for r in range(3)]
    _post(base, "/v1/runs/grpo/fragments", {"fragments": frags, "commits": commits})
    prom = prometheus(f"127.0.0.1:{service.port}")

    expected_num = float(Fraction(1e17) + Fraction(0.1) - Fraction(1e17))
    assert expected_num == 0.1 and (1e17 + 0.1) - 1e17 != 0.1
    rest = httpx.get(f"{base}/v1/runs/grpo/steps/0").json()["metrics"]
    assert rest["num"]["value"] == expected_num
    assert prom.value('steptally_metric_value{run="grpo",metric="num"}') == expected_num
    exact_mean = float(Fraction(0.1) / 7)
    assert rest["mean"]["value"] == exact_mean
    assert prom.value('steptally_metric_value{run="grpo",metric="mean"}') == exact_mean
    assert prom.value('steptally_metric_value{run="grpo",metric="peak"}') == 2.25
    assert math.isnan(prom.value('steptally_metric_value{run="grpo",metric="bad"}'))
    assert prom.value('steptally_open_steps{run="grpo"}') in (0.0, 1.0)

    # step 1: rank 0 alone, so it times out as partial with ranks 1 and 2 missing
    _post(
        base,
        "/v1/runs/grpo/fragments",
        {
            "fragments": [{"step": 1, "rank": 0, "seq": 0, "values": {"num": 1.0, "tokens": 1}}],
            "commits": [{"step": 1, "rank": 0, "fragments": 1}],
        },
    )
    # after the timeout the sweeper finalises step 1 as partial; the exposition follows
    assert prom.value('steptally_partial_steps{run="grpo"} == 1') == 1.0
    assert prom.value('steptally_missing_ranks{run="grpo"}') == 2.0
    assert prom.value('steptally_last_finalised_step{run="grpo"}') == 1.0
    assert prom.value('steptally_last_step_complete{run="grpo"}') == 0.0
    assert prom.value('steptally_metric_value{run="grpo",metric="num"}') == 1.0
    assert prom.value('steptally_fragments_accepted_total{run="grpo"}') == 4.0
    # the histogram is observed just after the sweep's commit, which a scrape may fall
    # between: wait for the scrape that has both finalisations
    assert prom.value("steptally_finalise_seconds_count == 2") == 2.0


def test_collector_yields_exact_samples_on_a_fresh_registry(api: Any, app: Any) -> None:
    api.register(
        world_size=2, metrics={"a": "sum", "n": "count", "lo": "min"}, derived={"q": "a / n"}
    )
    api.send(
        [
            (0, 0, 0, {"a": 1e17, "n": 1}),
            (0, 1, 0, {"a": 1.0, "n": 2}),
            (0, 1, 1, {"a": -1e17, "n": 0}),
        ],
        [(0, 0, 1), (0, 1, 2)],
    )
    api.send([(1, 0, 0, {"a": 2.0, "n": 1})], [(1, 0, 1)])
    registry = app.state.registry

    def sample(name: str, **labels: str) -> float | None:
        value: float | None = registry.get_sample_value(name, labels)
        return value

    assert sample("steptally_metric_value", run="r", metric="a") == 1.0
    assert sample("steptally_metric_value", run="r", metric="q") == 1.0 / 3.0
    assert sample("steptally_metric_value", run="r", metric="lo") is None  # undefined
    assert sample("steptally_last_finalised_step", run="r") == 0.0
    assert sample("steptally_open_steps", run="r") == 1.0
    assert sample("steptally_world_size", run="r") == 2.0
    text = api.client.get("/metrics")
    assert text.headers["content-type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(text.text)}
    assert {
        "steptally_metric_value",
        "steptally_fragments_accepted",
        "steptally_requests_rejected",
        "steptally_http_request_duration_seconds",
        "steptally_finalise_seconds",
        "steptally_open_steps",
    } <= names
    assert "step=" not in text.text  # no step label: a step number is a value
