"""What an operator polls: ``/healthz`` (the process answers), ``/readyz`` (the database
answers too, with its schema at head, within ``readyz_timeout_s``: a hung database is
503, not a hang) and ``/metrics`` (the Prometheus text exposition of the app's own
registry, :mod:`steptally.service.metrics`)."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from steptally.service.api.deps import ServiceDep
from steptally.service.api.errors import error_response
from steptally.service.api.schemas import HealthAnswer, JsonResponse, errors
from steptally.service.errors import NotMigrated
from steptally.service.metrics.registry import expose

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthAnswer)
async def healthz() -> JsonResponse:
    return JsonResponse({"status": "ok"})


@router.get("/readyz", response_model=HealthAnswer, responses=errors(503))
async def readyz(request: Request, service: ServiceDep) -> JsonResponse:
    timeout_s: float = request.app.state.settings.readyz_timeout_s
    try:
        with anyio.fail_after(timeout_s):  # the thread is left to its statement timeout
            await anyio.to_thread.run_sync(service.ready, abandon_on_cancel=True)
    except NotMigrated as exc:
        return error_response(request, 503, "not_ready", exc.message, None)
    except TimeoutError:
        message = f"the database did not answer within {timeout_s:g} s"
        return error_response(request, 503, "not_ready", message, None)
    except Exception as exc:  # any failure of the database means not ready
        message = f"the database does not answer: {type(exc).__name__}"
        return error_response(request, 503, "not_ready", message, None)
    return JsonResponse({"status": "ready"})


@router.get("/metrics", tags=["metrics"], include_in_schema=False)
def metrics(request: Request) -> Response:
    registry: CollectorRegistry = request.app.state.registry
    return Response(expose(registry), media_type=CONTENT_TYPE_LATEST)
