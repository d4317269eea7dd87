"""Run diagnostics (PostgreSQL): every metric and derived value of ``$run`` by step.

The x axis is the step, not a time: a Trend panel plots a numeric ascending field,
so a run's curve does not depend on when its steps were finalised (a partial step
revised an hour later stays where it belongs). The dashboard's time range therefore
does not filter these panels; the whole run is read. One panel per selected
metric (repeated over ``$metric``), because metrics differ in scale.

The SQL keeps at most ``2 × $points`` ordinary steps per metric: the range of steps
is cut into ``$points`` buckets and each keeps its step of least and of greatest
value, so a spike is never averaged away; every partial step, every revised step
and every NaN, infinite or undefined value is kept besides. Partial and revised
steps are marked, and so is every step that broke an alert rule on the metric: the
query repeats their value in the columns ``partial``, ``revised`` and ``breach``,
drawn as points over the line (Grafana's annotations are placed by time and would
not line up with a step axis; the live dashboard has them as annotations). Tables
count the steps by status, list the partial and revised steps with the ranks each
was missing, and list the alert breaches.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import table, trend
from grafana_foundation_sdk.builders.dashboard import CustomVariable, Dashboard, Row
from grafana_foundation_sdk.models.common import GraphDrawStyle, VisibilityMode
from grafana_foundation_sdk.models.dashboard import DynamicConfigValue, VariableOption

from steptally.service.grafana import variable
from steptally.service.grafana.datasource import POSTGRES, SqlQuery

UID = "steptally-run-diagnostics"
DEFAULT_POINTS = "1000"

VALUES_SQL = """\
WITH v AS (
  SELECT sv.step, sv.value, s.status, s.revision,
         EXISTS (SELECT 1 FROM breaches b
                 WHERE b.run_id = sv.run_id AND b.step = sv.step
                   AND b.breach::jsonb ->> 'metric' = m.name) AS breached,
         min(sv.step) OVER () AS first_step, max(sv.step) OVER () AS last_step
  FROM step_values sv
  JOIN runs r ON r.id = sv.run_id
  JOIN metrics m ON m.run_id = sv.run_id AND m.col = sv.col
  JOIN steps s ON s.run_id = sv.run_id AND s.step = sv.step
  WHERE r.name = '$run' AND m.name IN ($metric)
), b AS (
  SELECT v.*,
         row_number() OVER (PARTITION BY bucket ORDER BY value ASC NULLS LAST, step) AS low,
         row_number() OVER (PARTITION BY bucket ORDER BY value DESC NULLS LAST, step) AS high
  FROM (
    SELECT v.*, (step - first_step) * $points / (last_step - first_step + 1) AS bucket
    FROM v
  ) AS v
)
SELECT step, value,
       CASE WHEN status = 'partial' THEN value END AS partial,
       CASE WHEN revision > 1 THEN value END AS revised,
       CASE WHEN breached THEN value END AS breach
FROM b
WHERE low = 1 OR high = 1 OR status = 'partial' OR revision > 1 OR breached
   OR value IS NULL OR abs(value) = 'Infinity'
ORDER BY step"""

BREACHES_SQL = """\
SELECT b.step, b.rule, b.breach::jsonb ->> 'condition' AS condition,
       coalesce(b.breach::jsonb ->> 'metric', 'ranks') AS metric,
       b.breach::jsonb ->> 'value' AS value,
       b.breach::jsonb ->> 'threshold' AS threshold,
       b.breach::jsonb ->> 'mean' AS mean,
       b.revision, to_timestamp(b.finalised_at) AS finalised_at
FROM breaches b
JOIN runs r ON r.id = b.run_id
WHERE r.name = '$run'
ORDER BY b.step, b.rule"""

STATUS_SQL = """\
SELECT s.status, count(*) AS steps, count(*) FILTER (WHERE s.revision > 1) AS revised
FROM steps s
JOIN runs r ON r.id = s.run_id
WHERE r.name = '$run'
GROUP BY s.status
ORDER BY s.status"""

FLAGGED_SQL = """\
SELECT s.step, s.status, s.revision, s.missing_ranks,
       coalesce((SELECT string_agg(rank, ', ' ORDER BY rank::int)
                 FROM jsonb_array_elements_text(s.result::jsonb -> 'ranks_missing') AS rank),
                '') AS ranks_missing,
       to_timestamp(s.finalised_at) AS finalised_at
FROM steps s
JOIN runs r ON r.id = s.run_id
WHERE r.name = '$run' AND s.finalised_at IS NOT NULL
  AND (s.status = 'partial' OR s.revision > 1)
ORDER BY s.step"""


def _marker(color: str) -> list[DynamicConfigValue]:
    return [
        DynamicConfigValue("custom.drawStyle", "points"),
        DynamicConfigValue("custom.pointSize", 9),
        DynamicConfigValue("color", {"mode": "fixed", "fixedColor": color}),
    ]


def values_panel() -> trend.Panel:
    return (
        trend.Panel()
        .title("$metric by step")
        .description(
            "Finalised values by step; partial steps red, revised steps orange, steps that "
            "broke an alert rule on the metric purple."
        )
        .datasource(POSTGRES)
        .with_target(SqlQuery(VALUES_SQL))
        .x_field("step")
        .draw_style(GraphDrawStyle.LINE)
        .show_points(VisibilityMode.AUTO)
        .span_nulls(False)
        .override_by_name("partial", _marker("red"))
        .override_by_name("revised", _marker("orange"))
        .override_by_name("breach", _marker("purple"))
        .repeat("metric")
        .repeat_direction("h")
        .height(8)
        .span(12)
    )


def status_panel() -> table.Panel:
    return (
        table.Panel()
        .title("Steps by status")
        .description("Open, complete and partial steps; how many were finalised again.")
        .datasource(POSTGRES)
        .with_target(SqlQuery(STATUS_SQL))
        .height(8)
        .span(8)
    )


def flagged_panel() -> table.Panel:
    return (
        table.Panel()
        .title("Partial and revised steps")
        .description("Steps finalised partial, or finalised again; the ranks each was missing.")
        .datasource(POSTGRES)
        .with_target(SqlQuery(FLAGGED_SQL))
        .height(8)
        .span(16)
    )


def breaches_panel() -> table.Panel:
    return (
        table.Panel()
        .title("Alert breaches")
        .description(
            "Every step that broke one of the run's alert rules, once per rule, as the "
            "revision that first broke it showed it (values as the API writes them)."
        )
        .datasource(POSTGRES)
        .with_target(SqlQuery(BREACHES_SQL))
        .height(8)
        .span(24)
    )


def points_variable() -> CustomVariable:
    return (
        CustomVariable("points")
        .label("Buckets")
        .values("250,500,1000,2000,5000")
        .current(VariableOption(selected=True, text=DEFAULT_POINTS, value=DEFAULT_POINTS))
    )


def dashboard() -> Dashboard:
    return (
        Dashboard("Steptally: run diagnostics")
        .uid(UID)
        .tags(["steptally"])
        .time("now-24h", "now")
        .timezone("utc")
        .with_variable(variable.sql_run())
        .with_variable(variable.sql_metric())
        .with_variable(points_variable())
        .with_row(Row("Steps needing attention"))
        .with_panel(status_panel())
        .with_panel(flagged_panel())
        .with_panel(breaches_panel())
        .with_row(Row("Values by step"))
        .with_panel(values_panel())
    )
