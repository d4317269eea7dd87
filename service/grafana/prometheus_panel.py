"""Time-series and stat panels over the Prometheus datasource, built alike.

Every panel reads :data:`~steptally.service.grafana.datasource.PROMETHEUS`; each
target is a PromQL expression with its legend. Rates use Grafana's
``$__rate_interval`` (at least four scrape intervals), so a rate never sees fewer
than two samples.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.builders.common import VizLegendOptions
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement

from steptally.service.grafana.datasource import PROMETHEUS

Target = tuple[str, str]  # (PromQL expression, legend format)


def _queries(targets: tuple[Target, ...]) -> list[prometheus.Dataquery]:
    return [
        prometheus.Dataquery()
        .datasource(PROMETHEUS)
        .expr(expr)
        .legend_format(legend)
        .ref_id(chr(ord("A") + i))
        for i, (expr, legend) in enumerate(targets)
    ]


def graph(title: str, unit: str, *targets: Target) -> timeseries.Panel:
    """A time-series panel of ``targets``, legend as a table at the bottom."""
    panel = (
        timeseries.Panel()
        .title(title)
        .datasource(PROMETHEUS)
        .unit(unit)
        .legend(
            VizLegendOptions()
            .show_legend(True)
            .display_mode(LegendDisplayMode.TABLE)
            .placement(LegendPlacement.BOTTOM)
            .calcs(["lastNotNull", "max"])
        )
        .height(8)
        .span(12)
    )
    for query in _queries(targets):
        panel.with_target(query)
    return panel


def figure(title: str, unit: str, *targets: Target) -> stat.Panel:
    """A stat panel of the latest value of ``targets``."""
    panel = stat.Panel().title(title).datasource(PROMETHEUS).unit(unit).height(4).span(6)
    for query in _queries(targets):
        panel.with_target(query)
    return panel
