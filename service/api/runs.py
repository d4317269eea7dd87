"""``/v1/runs``: register, list and show runs."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from steptally.service.api.deps import GrantDep, RunName, ServiceDep, SettingsDep
from steptally.service.api.schemas import JsonResponse, RunAnswer, RunPage, errors
from steptally.service.settings import run_limits
from steptally.service.usecase.registration import RunRequest

router = APIRouter(prefix="/v1/runs", tags=["runs"])
_AGAIN = "the same spec again (or a superset adding metrics)"


class RunBody(BaseModel):
    """The body of ``POST /v1/runs``; the spec itself is checked by the algebra."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    world_size: int
    metrics: dict[str, Any]
    derived: dict[str, str] = Field(default_factory=dict)
    guards: dict[str, str] = Field(default_factory=dict)
    step_timeout_s: float | None = Field(default=None, allow_inf_nan=False)


@router.post(
    "",
    response_model=RunAnswer,
    status_code=201,
    responses=errors(
        400, 409, 413, 415, 422, also={200: {"model": RunAnswer, "description": _AGAIN}}
    ),
)
def register_run(
    body: RunBody, service: ServiceDep, grant: GrantDep, settings: SettingsDep
) -> JsonResponse:
    request = RunRequest(
        body.name,
        body.world_size,
        body.metrics,
        body.derived,
        body.step_timeout_s,
        body.guards,
        run_limits(settings),
    )
    run, created = service.register_run(request, grant)
    return JsonResponse(run, status_code=201 if created else 200)


@router.get("", response_model=RunPage, responses=errors(422))
def list_runs(service: ServiceDep, limit: int = 100, cursor: str | None = None) -> JsonResponse:
    return JsonResponse(service.list_runs(limit, cursor))


@router.get("/{run}", response_model=RunAnswer, responses=errors(404, 422))
def get_run(run: RunName, service: ServiceDep) -> JsonResponse:
    return JsonResponse(service.get_run(run))
