"""The dashboard's HTML pages, filled from the templates in ``templates/``.

A template is plain HTML with ``$name`` placeholders (:class:`string.Template`); every
value put in is HTML-escaped here, so a run name can never become markup.
"""

from __future__ import annotations

import html
from functools import cache
from importlib import resources
from string import Template

from steptally.service.dashboard.assets import UPLOT_VERSION


@cache
def _template(name: str) -> Template:
    folder = resources.files("steptally.service.dashboard").joinpath("templates")
    return Template(folder.joinpath(name).read_text(encoding="utf-8"))


def render(name: str, **values: str) -> str:
    """The template ``name`` with every ``$key`` replaced by the escaped value."""
    escaped = {k: html.escape(v, quote=True) for k, v in values.items()}
    return _template(name).substitute(uplot_version=UPLOT_VERSION, **escaped)


def runs_page() -> str:
    return render("runs.html")


def run_page(run: str) -> str:
    return render("run.html", run=run)


def missing_run_page(run: str) -> str:
    return render("missing.html", run=run)
