"""Live (Prometheus): the latest values and the progress of the selected runs.

Reads what ``/metrics`` exposes at every scrape (:mod:`steptally.service.metrics`): the
latest finalised value of every metric, finalisations and fragments as rates, and the
backlog of open, partial and missing.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard, Row

from steptally.service.grafana import variable
from steptally.service.grafana.prometheus_panel import figure, graph

UID = "steptally-live"
RUN = 'run=~"$run"'


def gauge(name: str, by: str = "run", match: str = RUN) -> str:
    """A per-run gauge that every replica exposes alike (each reads the same database):
    one series per run, not one per replica."""
    return f"max by ({by}) ({name}{{{match}}})"


def _progress_row(dashboard: Dashboard) -> Dashboard:
    return (
        dashboard.with_row(Row("Progress"))
        .with_panel(
            figure(
                "Last finalised step",
                "none",
                (gauge("steptally_last_finalised_step"), "{{run}}"),
            )
        )
        .with_panel(figure("Open steps", "none", (gauge("steptally_open_steps"), "{{run}}")))
        .with_panel(figure("Partial steps", "none", (gauge("steptally_partial_steps"), "{{run}}")))
        .with_panel(figure("Missing ranks", "none", (gauge("steptally_missing_ranks"), "{{run}}")))
    )


def _values_row(dashboard: Dashboard) -> Dashboard:
    values = gauge("steptally_metric_value", "run, metric", f'{RUN}, metric=~"$metric"')
    steps = f"sum by (run) (rate(steptally_steps_finalised_total{{{RUN}}}[$__rate_interval])) * 60"
    fragments = (
        f"sum by (run) (rate(steptally_fragments_accepted_total{{{RUN}}}[$__rate_interval]))"
    )
    return (
        dashboard.with_row(Row("Values and rates"))
        .with_panel(graph("Latest values", "none", (values, "{{run}} {{metric}}")).span(24))
        .with_panel(graph("Steps finalised per minute", "none", (steps, "{{run}}")))
        .with_panel(graph("Fragments stored per second", "ops", (fragments, "{{run}}")))
        .with_panel(
            graph(
                "Partial steps and missing ranks",
                "none",
                (gauge("steptally_partial_steps"), "{{run}} partial steps"),
                (gauge("steptally_missing_ranks"), "{{run}} missing ranks"),
            ).span(24)
        )
    )


def dashboard() -> Dashboard:
    board = (
        Dashboard("Steptally: live")
        .uid(UID)
        .tags(["steptally"])
        .time("now-30m", "now")
        .refresh("10s")
        .timezone("utc")
        .with_variable(variable.prometheus_run())
        .with_variable(variable.prometheus_metric())
    )
    return _values_row(_progress_row(board))
