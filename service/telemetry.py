"""The service's own Prometheus metrics, registered on the app's injected registry.

The use cases call these; the ``/metrics`` route and the collector of run values
are built on top of the same registry elsewhere. Never the global default registry:
each app (and each test) has its own.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from steptally.service.store.base import FinalisedStep, IngestOutcome

FINALISE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Telemetry:
    """Counters and histograms of ingest, rejects and finalisation."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.fragments_ingested = Counter(
            "steptally_fragments_ingested_total",
            "Fragments stored (duplicates not counted).",
            ["run"],
            registry=registry,
        )
        self.fragment_duplicates = Counter(
            "steptally_fragment_duplicates_total",
            "Fragments received again with the same values (acknowledged, counted once).",
            ["run"],
            registry=registry,
        )
        self.commits = Counter(
            "steptally_commits_total", "Commits recorded.", ["run"], registry=registry
        )
        self.rejects = Counter(
            "steptally_rejects_total",
            "Rejected requests by error code.",
            ["reason"],
            registry=registry,
        )
        self.batches = Counter(
            "steptally_batches_total", "Fragment batches stored.", registry=registry
        )
        self.finalise_seconds = Histogram(
            "steptally_finalise_seconds",
            "From the arrival of the request (or sweep) that finalises a step to its stored "
            "result.",
            buckets=FINALISE_BUCKETS,
            registry=registry,
        )
        self.steps_finalised = Counter(
            "steptally_steps_finalised_total",
            "Step finalisations, by resulting status.",
            ["run", "status"],
            registry=registry,
        )

    def batch_stored(self, run: str, outcome: IngestOutcome, seconds: float) -> None:
        self.batches.inc()
        if outcome.accepted:
            self.fragments_ingested.labels(run).inc(outcome.accepted)
        if outcome.duplicates:
            self.fragment_duplicates.labels(run).inc(outcome.duplicates)
        if outcome.commits:
            self.commits.labels(run).inc(outcome.commits)
        self.steps_done(outcome.finalised, seconds)

    def steps_done(self, steps: list[FinalisedStep], seconds: float) -> None:
        for step in steps:
            self.steps_finalised.labels(step.run, step.status.value).inc()
            self.finalise_seconds.observe(seconds)

    def rejected(self, code: str) -> None:
        self.rejects.labels(code).inc()
