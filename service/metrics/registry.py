"""One registry per app, and its text exposition.

:func:`build_registry` makes a fresh ``CollectorRegistry`` (never the global default
one: each app, and each test, has its own) with the service's instruments and the
collector of run values on it. :func:`expose` encodes it for ``GET /metrics``.

Counters and histograms carry a ``_created`` sample (the Unix time the series was
created) that the text format exposes as one more gauge per series; it says nothing
a dashboard reads, so the exposition leaves it out. It is dropped here, per scrape,
rather than by ``prometheus_client.disable_created_metrics()`` or the
``PROMETHEUS_DISABLE_CREATED_SERIES`` variable, which switch it off process-wide for
every registry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from steptally.service.domain.run import RunSnapshot
from steptally.service.metrics.instruments import Telemetry
from steptally.service.metrics.run_values import RunValueCollector


def build_registry(
    snapshot: Callable[[], Sequence[RunSnapshot]],
    window_s: float | None = None,
    clock: Callable[[], float] = time.time,
) -> tuple[CollectorRegistry, Telemetry]:
    """A fresh registry with the service's instruments and, read from ``snapshot()``
    at every scrape, the values of the runs active within ``window_s``."""
    registry = CollectorRegistry(auto_describe=True)
    telemetry = Telemetry(registry)
    registry.register(RunValueCollector(snapshot, window_s, clock))
    return registry, telemetry


class WithoutCreated(Collector):
    """The metric families of ``registry``, less their ``_created`` samples."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self._registry.collect():
            created = family.name + "_created"
            family.samples = [s for s in family.samples if s.name != created]
            yield family


def expose(registry: CollectorRegistry) -> bytes:
    """The Prometheus text format of ``registry``, without ``_created`` samples."""
    return generate_latest(WithoutCreated(registry))
