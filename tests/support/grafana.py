"""The queries of the built Grafana dashboards, interpolated as Grafana would.

The tests read the generated JSON (what Grafana loads), not the builders, and
replace the template variables the way each datasource does:

* Prometheus: a multi-valued variable becomes its value, or ``(a|b)`` for several
  (regex-escaped); ``$__rate_interval`` and ``$__interval`` become fixed durations;
* PostgreSQL: a multi-valued (or "All") variable becomes a quoted list ``'a','b'``;
  a single-valued one becomes its value, unquoted, with ``'`` doubled.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from steptally.service.grafana import build

PROMETHEUS = "prometheus"
POSTGRES = "grafana-postgresql-datasource"
BUILTINS = {"$__rate_interval": "15s", "$__interval": "5s"}


def dashboards() -> dict[str, Any]:
    return {name: json.loads(build.render(name)) for name in build.DASHBOARDS}


def targets(kind: str) -> Iterator[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """``(dashboard, panel title, target, dashboard JSON)`` of every ``kind`` target."""
    for name, board in dashboards().items():
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                if target["datasource"]["type"] == kind:
                    yield name, panel["title"], target, board


def annotations(kind: str) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """``(dashboard, annotation, dashboard JSON)`` of every annotation query on ``kind``."""
    for name, board in dashboards().items():
        for annotation in board.get("annotations", {}).get("list", []):
            if annotation["datasource"]["type"] == kind:
                yield name, annotation, board


def query_variables(kind: str) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """``(dashboard, variable, dashboard JSON)`` of every query variable on ``kind``."""
    for name, board in dashboards().items():
        for variable in board["templating"]["list"]:
            if variable["type"] == "query" and variable["datasource"]["type"] == kind:
                yield name, variable, board


def _replace(text: str, values: dict[str, str]) -> str:
    for name in sorted(values, key=len, reverse=True):  # $points before $p
        text = text.replace(name, values[name])
    assert not re.search(r"\$[A-Za-z_{]", text), f"a variable is left in {text}"
    return text


def _regex(options: list[str]) -> str:
    escaped = [re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", v) for v in options]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def promql(expr: str, values: dict[str, list[str]]) -> str:
    named = {f"${k}": _regex(v) for k, v in values.items()}
    return _replace(expr, {**BUILTINS, **named})


def sql(
    text: str,
    board: dict[str, Any],
    values: dict[str, list[str]],
    epoch: tuple[float, float] | None = None,
) -> str:
    """``text`` as Grafana sends it; ``${name:regex}`` as the regex formatter writes it
    (the value, or ``(a|b)``, regex-escaped; All: the variable's allValue), and
    ``$__unixEpochFilter(col)`` over the dashboard's time range ``epoch`` (seconds)."""
    variables = {v["name"]: v for v in board["templating"]["list"]}
    for name, options in values.items():
        all_value = variables[name].get("allValue")
        regex = all_value if options == ["$__all"] and all_value else _regex(options)
        text = text.replace("${" + name + ":regex}", regex)
    if epoch is not None:
        start, end = epoch
        text = re.sub(
            r"\$__unixEpochFilter\(([^)]+)\)", rf"\1 >= {start:.0f} AND \1 <= {end:.0f}", text
        )

    def literal(name: str, options: list[str]) -> str:
        variable = variables[name]
        if variable.get("multi") or variable.get("includeAll"):
            return ",".join("'" + v.replace("'", "''") + "'" for v in options)
        (only,) = options
        return only.replace("'", "''")

    left = {k: v for k, v in values.items() if f"${k}" in text}
    return _replace(text, {f"${k}": literal(k, v) for k, v in left.items()})
