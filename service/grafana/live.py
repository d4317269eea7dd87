"""Live (Prometheus): the latest values and the progress of the selected runs.

Reads what ``/metrics`` exposes at every scrape (:mod:`steptally.service.exposition`
and :mod:`steptally.service.telemetry`): the latest finalised value of every
metric, finalisations and fragments as rates, and the backlog of open, partial
and missing.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard, Row

from steptally.service.grafana import variable
from steptally.service.grafana.prometheus_panel import figure, graph

UID = "steptally-live"
RUN = 'run=~"$run"'


def _progress_row(dashboard: Dashboard) -> Dashboard:
    return (
        dashboard.with_row(Row("Progress"))
        .with_panel(
            figure(
                "Last finalised step",
                "none",
                (f"steptally_last_finalised_step{{{RUN}}}", "{{run}}"),
            )
        )
        .with_panel(figure("Open steps", "none", (f"steptally_open_steps{{{RUN}}}", "{{run}}")))
        .with_panel(
            figure("Partial steps", "none", (f"steptally_partial_steps{{{RUN}}}", "{{run}}"))
        )
        .with_panel(
            figure("Missing ranks", "none", (f"steptally_missing_ranks{{{RUN}}}", "{{run}}"))
        )
    )


def _values_row(dashboard: Dashboard) -> Dashboard:
    values = f'steptally_metric_value{{{RUN}, metric=~"$metric"}}'
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
                (f"steptally_partial_steps{{{RUN}}}", "{{run}} partial steps"),
                (f"steptally_missing_ranks{{{RUN}}}", "{{run}} missing ranks"),
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
