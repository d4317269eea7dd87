"""``/v1/runs``: register, list and show runs."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.config import JsonDict

from steptally.client.algebra.alerts import MAX_RULES, MAX_WINDOW
from steptally.client.algebra.kind import NAME_PATTERN, Kind
from steptally.service.api.deps import (
    RUN_PATTERN,
    GrantDep,
    RunCursor,
    RunName,
    ServiceDep,
    SettingsDep,
)
from steptally.service.api.schemas import JsonResponse, RunAnswer, RunPage, errors
from steptally.service.settings import run_limits
from steptally.service.usecase.query import MAX_PAGE
from steptally.service.usecase.registration import RunRequest

router = APIRouter(prefix="/v1/runs", tags=["runs"])
_AGAIN = "the same spec again (or a superset adding metrics)"
_NAME: JsonDict = {"pattern": f"^{NAME_PATTERN.pattern}$"}  # a metric's name, in the schema
_NUMBER: JsonDict = {"type": "number"}
_RULE: JsonDict = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", **_NAME},
        "metric": {"type": "string", **_NAME},
        "above": _NUMBER,
        "below": _NUMBER,
        "change_above": {"type": "number", "minimum": 0},
        "window": {"type": "integer", "minimum": 1, "maximum": MAX_WINDOW},
        "relative": {"type": "boolean"},
        "missing_ranks_above": {"type": "integer", "minimum": 0},
        "non_finite": {"type": "boolean"},
    },
}


class RunBody(BaseModel):
    """The body of ``POST /v1/runs``; the spec itself is checked by the algebra."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(json_schema_extra={"pattern": RUN_PATTERN, "maxLength": 128})
    # the bounds the service's settings set are written into /openapi.json by
    # service/api/docs.py (describe_limits); the checks themselves stay the algebra's
    world_size: int = Field(json_schema_extra={"minimum": 1})
    metrics: dict[str, Any] = Field(
        json_schema_extra={
            "propertyNames": _NAME,
            "additionalProperties": {"enum": [k.value for k in Kind]},
        }
    )
    derived: dict[str, str] = Field(
        default_factory=dict,
        json_schema_extra={"propertyNames": _NAME},
    )
    guards: dict[str, str] = Field(
        default_factory=dict,
        json_schema_extra={"propertyNames": _NAME},
    )
    step_timeout_s: float | None = Field(
        default=None, allow_inf_nan=False, json_schema_extra={"exclusiveMinimum": 0}
    )
    # each rule is checked by the algebra (steptally.client.algebra.alerts)
    alerts: list[dict[str, Any]] = Field(
        default_factory=list,
        json_schema_extra={"maxItems": MAX_RULES, "items": _RULE},
    )

    @field_validator("world_size", mode="before")
    @classmethod
    def _integral(cls, value: Any) -> Any:
        """381.0 is the integer 381 in JSON (Schema); 381.5 and "381" are not."""
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value


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
        body.alerts,
    )
    run, created = service.register_run(request, grant)
    return JsonResponse(run, status_code=201 if created else 200)


@router.get("", response_model=RunPage, responses=errors(422))
def list_runs(
    service: ServiceDep,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    cursor: RunCursor = None,
) -> JsonResponse:
    return JsonResponse(service.list_runs(limit, cursor))


@router.get("/{run}", response_model=RunAnswer, responses=errors(404, 422))
def get_run(run: RunName, service: ServiceDep) -> JsonResponse:
    return JsonResponse(service.get_run(run))
