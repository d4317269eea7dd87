"""Live (Prometheus): the latest values and the progress of the selected runs.

Reads what ``/metrics`` exposes at every scrape (:mod:`steptally.service.metrics`): the
latest finalised value of every metric, finalisations and fragments as rates, and the
backlog of open, partial and missing.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import AnnotationQuery, Dashboard, Row

from steptally.service.grafana import variable
from steptally.service.grafana.datasource import POSTGRES, SqlQuery
from steptally.service.grafana.prometheus_panel import figure, graph

UID = "steptally-live"
RUN = 'run=~"$run"'
# Grafana's annotation query on PostgreSQL: time in ms, text, tags (a comma list)
BREACH_ANNOTATIONS_SQL = """\
SELECT b.finalised_at * 1000 AS time,
       r.name || ' step ' || b.step || ': ' || b.rule || ' (' ||
         coalesce(b.breach::jsonb ->> 'metric', 'missing ranks') || ' = ' ||
         (b.breach::jsonb ->> 'value') || ')' AS text,
       r.name || ',' || b.rule AS tags
FROM breaches b
JOIN runs r ON r.id = b.run_id
WHERE r.name ~ '^${run:regex}$' AND $__unixEpochFilter(b.finalised_at)
ORDER BY b.finalised_at, r.name, b.step, b.rule"""


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
                "Alert breaches",
                "none",
                (
                    "max by (run, rule) (increase(steptally_alert_breaches_total"
                    f"{{{RUN}}}[$__rate_interval]))",
                    "{{run}} {{rule}}",
                ),
            ).span(24)
        )
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
        .annotation(breach_annotations())
    )
    return _values_row(_progress_row(board))


def breach_annotations() -> AnnotationQuery:
    """Every alert breach of the selected runs, at the time its step was finalised."""
    # Grafana's SQL datasources read an annotation's query from its target, as a panel's
    target = SqlQuery(BREACH_ANNOTATIONS_SQL, ref_id="Anno")
    return (
        AnnotationQuery()
        .name("Alert breaches")
        .datasource(POSTGRES)
        .enable(True)
        .icon_color("red")
        .target(target)  # type: ignore[arg-type]
    )
