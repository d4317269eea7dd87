"""The ``run`` and ``metric`` template variables, as query variables of a datasource.

On PostgreSQL, ``run`` is single-valued (a diagnostics page is about one run) and
Grafana puts its value into the SQL unquoted, so queries write ``'$run'``;
``metric`` is multi-valued and interpolates as a quoted list, so queries write
``IN ($metric)``. On Prometheus both are multi-valued and interpolate as a regex
alternation, so queries write ``=~"$run"``; "All" is ``.*``. Every multi-valued
variable starts at "All".
"""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import QueryVariable
from grafana_foundation_sdk.models.dashboard import VariableOption, VariableRefresh, VariableSort

from steptally.service.grafana.datasource import POSTGRES, PROMETHEUS

ALL = VariableOption(selected=True, text=["All"], value=["$__all"])  # preselected
RUNS_SQL = "SELECT name FROM runs ORDER BY name"
METRICS_SQL = (
    "SELECT m.name FROM metrics m JOIN runs r ON r.id = m.run_id "
    "WHERE r.name = '$run' ORDER BY m.name"
)


def _variable(name: str, label: str, query: str) -> QueryVariable:
    return (
        QueryVariable(name)
        .label(label)
        .query(query)
        .refresh(VariableRefresh.ON_DASHBOARD_LOAD)
        .sort(VariableSort.ALPHABETICAL_ASC)
    )


def sql_run() -> QueryVariable:
    return _variable("run", "Run", RUNS_SQL).datasource(POSTGRES).multi(False)


def sql_metric() -> QueryVariable:
    return (
        _variable("metric", "Metric", METRICS_SQL)
        .datasource(POSTGRES)
        .multi(True)
        .include_all(True)
        .current(ALL)
    )


def prometheus_run() -> QueryVariable:
    return _prometheus("run", "Run", "label_values(steptally_world_size, run)")


def prometheus_metric() -> QueryVariable:
    query = 'label_values(steptally_metric_value{run=~"$run"}, metric)'
    return _prometheus("metric", "Metric", query)


def _prometheus(name: str, label: str, query: str) -> QueryVariable:
    return (
        _variable(name, label, query)
        .datasource(PROMETHEUS)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(ALL)
    )
