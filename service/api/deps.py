"""What the routes take, as ``Annotated`` aliases: the app's objects, and path and query
parameters validated before a route runs (422 ``invalid_payload`` with ``where`` such
as ``path.run`` or ``query.start``) and documented in OpenAPI.

A run name in a path must match the contract's pattern in full (no trailing newline,
NUL, leading space or non-ASCII: nothing the database could choke on); steps and
step bounds are integers from 0 to 2**63 - 1.

The app's objects are read by ``async`` functions: FastAPI runs a plain ``def``
dependency in the thread pool, a hand-off to a worker thread and back for every one
of them on every request.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Query, Request

from steptally.service.auth.grant import Grant
from steptally.service.domain.limits import MAX_INT
from steptally.service.settings import Settings
from steptally.service.usecase.facade import Service

RUN_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"

# an event id as the events route sends it: ``finalised_at`` (a float's repr), step, revision
EVENT_ID_PATTERN = r"^[0-9]{1,20}(\.[0-9]{1,20})?(e[+-]?[0-9]{1,3})?:[0-9]{1,18}:[0-9]{1,18}$"

RunName = Annotated[str, Path(pattern=RUN_PATTERN, max_length=128)]
StepNumber = Annotated[int, Path(ge=0, le=MAX_INT)]
StepBound = Annotated[int | None, Query(ge=0, le=MAX_INT)]
# a page's next_cursor: a run name, or a step number
RunCursor = Annotated[str | None, Query(pattern=RUN_PATTERN, max_length=128)]
StepCursor = Annotated[str | None, Query(pattern=r"^[0-9]{1,19}$")]


async def _service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


async def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def _grant(request: Request) -> Grant:
    """What the caller may register (set by the auth guard; anything when auth is off)."""
    grant: Grant = getattr(request.state, "grant", Grant.ANY)
    return grant


ServiceDep = Annotated[Service, Depends(_service)]
GrantDep = Annotated[Grant, Depends(_grant)]
SettingsDep = Annotated[Settings, Depends(_settings)]
