"""``GET /metrics``: the Prometheus text exposition of the app's own registry
(:mod:`steptally.service.metrics`)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from steptally.service.metrics.registry import expose

router = APIRouter(tags=["metrics"])


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    registry: CollectorRegistry = request.app.state.registry
    return Response(expose(registry), media_type=CONTENT_TYPE_LATEST)
