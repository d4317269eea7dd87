"""Static files of the dashboard, served with ``Cache-Control``.

Two folders of the package are served: ``static/`` (the pages' own scripts and
styles) and ``vendor/`` (uPlot, untouched from its npm release). The own files change
with the package, so the browser keeps them but revalidates (``no-cache``; the ETag
gets a 304). The vendored files are referenced with their version in the URL and
never change under it, so they are cached for a year.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from fastapi import FastAPI
from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

OWN_CACHE = "no-cache"
VENDOR_CACHE = "public, max-age=31536000, immutable"
UPLOT_VERSION = "1.6.32"


def package_folder(name: str) -> Path:
    """A folder of this package, wherever it is installed."""
    return Path(str(resources.files("steptally.service.dashboard").joinpath(name)))


class CachedStaticFiles(StaticFiles):
    """``StaticFiles`` whose every file answer carries one ``Cache-Control`` header."""

    def __init__(self, directory: Path, cache_control: str) -> None:
        super().__init__(directory=directory, check_dir=True)
        self.cache_control = cache_control

    def file_response(
        self,
        full_path: str | os.PathLike[str],
        stat_result: os.stat_result,
        scope: Scope,
        status_code: int = 200,
    ) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers["Cache-Control"] = self.cache_control
        return response


def mount_assets(app: FastAPI) -> None:
    """Serve ``/dashboard/static/...`` and ``/dashboard/vendor/...``."""
    own = CachedStaticFiles(package_folder("static"), OWN_CACHE)
    vendored = CachedStaticFiles(package_folder("vendor"), VENDOR_CACHE)
    app.mount("/dashboard/static", own, name="dashboard-static")
    app.mount("/dashboard/vendor", vendored, name="dashboard-vendor")
