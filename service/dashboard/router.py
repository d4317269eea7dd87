"""``GET /`` (the runs list) and ``GET /runs/{run}`` (one run), as HTML.

The pages fetch their data from the REST API in the browser; here a run page only
checks that the run exists, so an unknown run answers a 404 page with a link back.
With auth on the pages are open to anyone and hold no data (their scripts read the
API with a read token, ``static/auth.js``), so a run page is served without that
check: whether a run exists is for a read token to learn.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse

from steptally.service.api.deps import ServiceDep
from steptally.service.dashboard.assets import mount_assets
from steptally.service.dashboard.page import missing_run_page, run_page, runs_page
from steptally.service.domain.run import is_run_name
from steptally.service.errors import UnknownRun

router = APIRouter(tags=["dashboard"], include_in_schema=False)

PAGE_CACHE = {"Cache-Control": "no-cache"}


@router.get("/", response_class=HTMLResponse)
def runs_list() -> HTMLResponse:
    return HTMLResponse(runs_page(), headers=PAGE_CACHE)


@router.get("/runs/{run}", response_class=HTMLResponse)
def run_view(run: str, service: ServiceDep, request: Request) -> HTMLResponse:
    if request.app.state.settings.auth:
        return HTMLResponse(run_page(run), headers=PAGE_CACHE)
    try:
        if not is_run_name(run):  # never a database lookup of a name no run can have
            raise UnknownRun("not a run name")
        service.runs.get(run)  # the known runs, not the run's summary (a count of its steps)
    except UnknownRun:
        return HTMLResponse(missing_run_page(run), status_code=404, headers=PAGE_CACHE)
    return HTMLResponse(run_page(run), headers=PAGE_CACHE)


def install(app: FastAPI) -> None:
    """Add the pages and their static files to ``app``."""
    app.include_router(router)
    mount_assets(app)
