"""What the run page exposes for tests: ``window.steptally`` (the page object)."""

from __future__ import annotations

import json

from playwright.sync_api import Page

# the columns of a chart's uPlot data: x, the run's line, partial, revised, non-finite and
# alert-breach markers, then one line per overlaid run
PARTIAL_MARKERS, REVISED_MARKERS, NON_FINITE_MARKERS, BREACH_MARKERS = 2, 3, 4, 5
FIRST_OVERLAY = 6


def marked_steps(page: Page, metric: str, column: int) -> list[int]:
    """The steps that carry a value in ``column`` of the chart of ``metric``."""
    script = "([m, k]) => { const d = steptally.charts.get(m).uplot.data;"
    script += " return d[0].filter((_, i) => d[k][i] != null); }"
    steps: list[int] = page.evaluate(script, [metric, column])
    return steps


def column(page: Page, metric: str, index: int) -> list[float | None]:
    """One column of the chart's data, gaps (null and undefined) as None."""
    script = "([m, k]) => steptally.charts.get(m).uplot.data[k].map((v) => v ?? null)"
    values: list[float | None] = page.evaluate(script, [metric, index])
    return values


def wait_for_marked(page: Page, metric: str, column: int, steps: list[int]) -> None:
    """Wait until exactly ``steps`` carry a value in ``column`` (live redraws are per frame)."""
    script = "([m, k, want]) => { const c = steptally.charts.get(m); const d = c.uplot?.data;"
    script += " if (!d) return false;"
    script += " return JSON.stringify(d[0].filter((_, i) => d[k][i] != null)) === want; }"
    page.wait_for_function(script, arg=[metric, column, json.dumps(steps, separators=(",", ":"))])
