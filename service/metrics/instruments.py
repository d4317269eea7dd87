"""The service's own Prometheus metrics, registered on the app's injected registry.

The use cases, the error handler and the request middleware call these;
:func:`~steptally.service.metrics.registry.build_registry` puts them on a fresh
registry beside the collector of run values. Never the global default registry: each
app (and each test) has its own. The names (``/metrics`` shows the HELP text of each):

* ``steptally_http_request_duration_seconds{method, route, status}`` — histogram of the
  time from a request's arrival to its response headers, by HTTP method, route
  template (``/v1/runs/{run}/fragments``, never the raw path; ``unmatched`` when no
  route matched) and HTTP status code; its ``_count`` is the request counter;
* ``steptally_fragments_accepted_total{run}`` — fragments stored;
* ``steptally_fragments_duplicate_total{run}`` — fragments received again with the same
  values (acknowledged, stored once);
* ``steptally_fragments_rejected_total{run, code}`` — fragments not stored, by the error
  code that refused them: every fragment of a batch refused whole, and each fragment
  a partial batch left out;
* ``steptally_requests_rejected_total{code}`` — requests answered with an error, by the
  error code of the JSON answer (``fragment_conflict``, ``invalid_payload``, ...); a
  rejected batch stores none of its fragments;
* ``steptally_commits_total{run}`` and ``steptally_batches_total`` — commits and
  batches stored;
* ``steptally_finalise_seconds`` — histogram of the time from the arrival of the
  request (or sweep) that finalises a step to its stored result;
* ``steptally_steps_finalised_total{run, status}`` — finalisations by resulting status
  (``complete`` or ``partial``; a revision counts again).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from steptally.service.store.protocol import FinalisedStep, IngestOutcome

FINALISE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.0005, *FINALISE_BUCKETS)


class Telemetry:
    """Counters and histograms of requests, ingest, rejects and finalisation."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.request_seconds = Histogram(
            "steptally_http_request_duration_seconds",
            "From a request's arrival to its response headers, by method, route template "
            "and status code.",
            ["method", "route", "status"],
            buckets=REQUEST_BUCKETS,
            registry=registry,
        )
        self.fragments_accepted = Counter(
            "steptally_fragments_accepted_total", "Fragments stored.", ["run"], registry=registry
        )
        self.fragments_duplicate = Counter(
            "steptally_fragments_duplicate_total",
            "Fragments received again with the same values (acknowledged, stored once).",
            ["run"],
            registry=registry,
        )
        self.fragments_rejected = Counter(
            "steptally_fragments_rejected_total",
            "Fragments not stored, by the error code that refused them.",
            ["run", "code"],
            registry=registry,
        )
        self.commits = Counter(
            "steptally_commits_total", "Commits stored.", ["run"], registry=registry
        )
        self.requests_rejected = Counter(
            "steptally_requests_rejected_total",
            "Requests answered with an error, by the error code of the answer.",
            ["code"],
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
        # the labelled children of the hot paths, looked up once (never removed: the
        # metrics keep every label set they were given anyway)
        self._requests: dict[tuple[str, str, int], Histogram] = {}
        self._runs: dict[str, tuple[Counter, Counter, Counter]] = {}

    def request_done(self, method: str, route: str, status: int, seconds: float) -> None:
        key = (method, route, status)
        child = self._requests.get(key)
        if child is None:  # prometheus_client checks and locks on every labels() call
            child = self._requests[key] = self.request_seconds.labels(method, route, str(status))
        child.observe(seconds)

    def batch_stored(self, run: str, outcome: IngestOutcome, seconds: float) -> None:
        self.batches.inc()
        children = self._runs.get(run)
        if children is None:
            children = self._runs[run] = (
                self.fragments_accepted.labels(run),
                self.fragments_duplicate.labels(run),
                self.commits.labels(run),
            )
        accepted, duplicate, commits = children
        if outcome.accepted:
            accepted.inc(outcome.accepted)
        if outcome.duplicates:
            duplicate.inc(outcome.duplicates)
        if outcome.commits:
            commits.inc(outcome.commits)
        self.steps_done(outcome.finalised, seconds)

    def steps_done(self, steps: list[FinalisedStep], seconds: float) -> None:
        for step in steps:
            self.steps_finalised.labels(step.run, step.status.value).inc()
            self.finalise_seconds.observe(seconds)

    def fragments_refused(self, run: str, code: str, n: int = 1) -> None:
        if n:
            self.fragments_rejected.labels(run, code).inc(n)

    def rejected(self, code: str) -> None:
        self.requests_rejected.labels(code).inc()
