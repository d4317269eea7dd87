"""Render the dashboards to JSON, write them, and check committed files against them.

Each dashboard is encoded with the SDK's JSON encoder (sorted keys, two-space
indent, a final newline), so a build is byte-for-byte reproducible and
``check`` can compare it with what is committed. Panels are numbered 1, 2, ...
in the order they appear (Grafana wants ids unique within a dashboard).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from grafana_foundation_sdk.builders.dashboard import Dashboard
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from steptally.service.grafana import live, run_diagnostics, service_health

DEFAULT_DIR = Path("deploy/grafana/dashboards")
DASHBOARDS: dict[str, Callable[[], Dashboard]] = {
    "run-diagnostics": run_diagnostics.dashboard,
    "live": live.dashboard,
    "service-health": service_health.dashboard,
}


def render(name: str) -> str:
    """The JSON text of dashboard ``name``."""
    board = DASHBOARDS[name]().build()
    for number, panel in enumerate(board.panels or [], start=1):
        panel.id_val = number
    return JSONEncoder(sort_keys=True, indent=2).encode(board) + "\n"


def write(directory: Path = DEFAULT_DIR) -> list[Path]:
    """Write every dashboard as ``<name>.json`` into ``directory``; the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name in DASHBOARDS:
        path = directory / f"{name}.json"
        path.write_text(render(name), encoding="utf-8")
        written.append(path)
    return written


def stale(directory: Path = DEFAULT_DIR) -> list[Path]:
    """The dashboard files in ``directory`` that are missing or differ from a build."""
    paths = ((directory / f"{name}.json", name) for name in DASHBOARDS)
    return [p for p, name in paths if not p.is_file() or p.read_text("utf-8") != render(name)]
