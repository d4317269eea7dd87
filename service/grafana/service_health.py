"""Service health (Prometheus): requests, errors, ingest and finalisation.

Requests by route template and HTTP status come from
``steptally_http_request_duration_seconds`` (its ``_count`` is the request count);
rejections by error code from ``steptally_requests_rejected_total`` (requests) and
``steptally_fragments_rejected_total`` (fragments); ingest from
the fragment and batch counters; finalisation latency from
``steptally_finalise_seconds``; the backlog from ``steptally_open_steps``.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard, Row

from steptally.service.grafana import variable
from steptally.service.grafana.prometheus_panel import Target, graph

UID = "steptally-service-health"
RATE = "[$__rate_interval]"
REQUESTS = f"rate(steptally_http_request_duration_seconds_count{RATE})"
QUANTILES = (0.5, 0.9, 0.99)


def _quantiles(histogram: str, by: str, legend: str) -> tuple[Target, ...]:
    buckets = f"sum by ({by}le) (rate({histogram}_bucket{RATE}))"
    return tuple(
        (f"histogram_quantile({q}, {buckets})", f"p{round(q * 100)} {legend}") for q in QUANTILES
    )


def _requests_row(dashboard: Dashboard) -> Dashboard:
    failed = 'steptally_http_request_duration_seconds_count{status=~"4..|5.."}'
    errors = f"sum by (route, status) (rate({failed}{RATE}))"
    latency = _quantiles("steptally_http_request_duration_seconds", "route, ", "{{route}}")
    rejected = f"sum by (code) (rate(steptally_requests_rejected_total{RATE}))"
    return (
        dashboard.with_row(Row("Requests"))
        .with_panel(
            graph(
                "Requests per second",
                "reqps",
                (f"sum by (route, status) ({REQUESTS})", "{{route}} {{status}}"),
            )
        )
        .with_panel(graph("Latency by route", "s", *latency))
        .with_panel(
            graph(
                "Errors per second by route and status", "reqps", (errors, "{{route}} {{status}}")
            )
        )
        .with_panel(graph("Rejections per second by error code", "reqps", (rejected, "{{code}}")))
    )


def _ingest_row(dashboard: Dashboard) -> Dashboard:
    run = '{run=~"$run"}'
    accepted = f"sum by (run) (rate(steptally_fragments_accepted_total{run}{RATE}))"
    duplicate = f"sum by (run) (rate(steptally_fragments_duplicate_total{run}{RATE}))"
    refused = f"sum by (run, code) (rate(steptally_fragments_rejected_total{run}{RATE}))"
    batches = f"sum(rate(steptally_batches_total{RATE}))"
    return (
        dashboard.with_row(Row("Ingest and finalisation"))
        .with_panel(
            graph(
                "Ingest per second",
                "ops",
                (accepted, "{{run}} fragments stored"),
                (duplicate, "{{run}} duplicates"),
                (refused, "{{run}} refused: {{code}}"),
                (batches, "batches"),
            )
        )
        .with_panel(
            graph("Finalise latency", "s", *_quantiles("steptally_finalise_seconds", "", ""))
        )
        .with_panel(
            graph("Open steps", "none", (f"max by (run) (steptally_open_steps{run})", "{{run}}"))
        )
    )


def dashboard() -> Dashboard:
    board = (
        Dashboard("Steptally: service health")
        .uid(UID)
        .tags(["steptally"])
        .time("now-1h", "now")
        .refresh("30s")
        .timezone("utc")
        .with_variable(variable.prometheus_run())
    )
    return _ingest_row(_requests_row(board))
