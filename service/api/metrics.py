"""``GET /metrics``: the Prometheus text exposition of the app's own registry.

Counters and histograms carry a ``_created`` sample (the Unix time the series was
created) that the text format exposes as one more gauge per series; it says nothing
a dashboard reads, so the exposition leaves it out. It is dropped here, per scrape,
rather than by ``prometheus_client.disable_created_metrics()`` or the
``PROMETHEUS_DISABLE_CREATED_SERIES`` variable, which switch it off process-wide for
every registry.
"""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

router = APIRouter(tags=["metrics"])


class WithoutCreated(Collector):
    """The metric families of ``registry``, less their ``_created`` samples."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self._registry.collect():
            created = family.name + "_created"
            family.samples = [s for s in family.samples if s.name != created]
            yield family


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    registry: CollectorRegistry = request.app.state.registry
    return Response(generate_latest(WithoutCreated(registry)), media_type=CONTENT_TYPE_LATEST)
