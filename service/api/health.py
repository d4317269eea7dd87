"""``/healthz`` (the process answers) and ``/readyz`` (the database answers too)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from steptally.service.api.deps import ServiceDep
from steptally.service.api.errors import error_response
from steptally.service.api.response import JsonResponse
from steptally.service.api.schemas import HealthAnswer, errors

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthAnswer)
async def healthz() -> JsonResponse:
    return JsonResponse({"status": "ok"})


@router.get("/readyz", response_model=HealthAnswer, responses=errors(503))
def readyz(request: Request, service: ServiceDep) -> JsonResponse:
    try:
        service.store.ping()
    except Exception as exc:  # any failure of the database means not ready
        message = f"the database does not answer: {type(exc).__name__}"
        return error_response(request, 503, "not_ready", message, None)
    return JsonResponse({"status": "ready"})
