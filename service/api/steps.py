"""``/v1/runs/{run}/steps``, ``/series`` and ``/breaches``: finalised and open steps, and
the steps that broke an alert rule, for people and plots."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from steptally.service.api.deps import RunName, ServiceDep, StepBound, StepCursor, StepNumber
from steptally.service.api.schemas import (
    BreachPage,
    JsonResponse,
    SeriesAnswer,
    StepAnswer,
    StepPage,
    errors,
)
from steptally.service.usecase.query import BREACH_CURSOR_PATTERN, MAX_PAGE, MAX_POINTS, MIN_POINTS

router = APIRouter(prefix="/v1/runs", tags=["steps"])


@router.get("/{run}/steps/{step}", response_model=StepAnswer, responses=errors(404, 422))
def get_step(run: RunName, step: StepNumber, service: ServiceDep) -> JsonResponse:
    return JsonResponse(service.get_step(run, step))


@router.get("/{run}/steps", response_model=StepPage, responses=errors(404, 422))
def list_steps(
    run: RunName,
    service: ServiceDep,
    start: StepBound = None,
    end: StepBound = None,
    metric: Annotated[list[str] | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    cursor: StepCursor = None,
) -> JsonResponse:
    page = service.list_steps(run, start, end, metric or [], limit, cursor)
    return JsonResponse(page)


@router.get("/{run}/series/{metric}", response_model=SeriesAnswer, responses=errors(404, 422))
def series(
    run: RunName,
    metric: str,
    service: ServiceDep,
    start: StepBound = None,
    end: StepBound = None,
    points: Annotated[int | None, Query(ge=MIN_POINTS, le=MAX_POINTS)] = None,
) -> JsonResponse:
    return JsonResponse(service.series(run, metric, start, end, points))


@router.get("/{run}/breaches", response_model=BreachPage, responses=errors(404, 422))
def list_breaches(
    run: RunName,
    service: ServiceDep,
    start: StepBound = None,
    end: StepBound = None,
    rule: Annotated[list[str] | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    cursor: Annotated[str | None, Query(pattern=BREACH_CURSOR_PATTERN)] = None,
) -> JsonResponse:
    return JsonResponse(service.list_breaches(run, start, end, rule or [], limit, cursor))
