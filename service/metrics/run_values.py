"""The Prometheus collector of run values: fresh metric families at every scrape.

It reads one snapshot of the store per scrape (the latest finalised step of every
run and the backlog of open and partial steps) and yields:

* ``steptally_metric_value{run, metric}`` — the latest finalised value of every
  metric and derived value; an undefined value is left out, a non-finite one is
  exported as it is (NaN, +Inf, -Inf);
* ``steptally_last_finalised_step{run}`` and ``steptally_last_finalised_revision{run}``;
* ``steptally_last_step_complete{run}`` — 1 when that step is complete, 0 when partial;
* ``steptally_open_steps{run}``, ``steptally_partial_steps{run}`` and
  ``steptally_missing_ranks{run}`` (summed over the partial steps);
* ``steptally_world_size{run}``;
* ``steptally_oldest_open_step_age_seconds{run}`` and
  ``steptally_oldest_open_step_missing_ranks{run}`` — how long the run's lowest open
  step has waited and how many ranks it still misses (only while a step is open);
* ``steptally_alert_breaches_total{run, rule}`` — the steps that broke each alert rule
  of the run, every rule exported from 0 (so that ``increase()`` sees the first one),
  read from the store: every replica shows the same count.

No step label: a step number is a value, not a series. With ``window_s``, only the
runs active within it are shown (registered or finalised a step since, or with open
steps), so the exposition stays bounded however many runs the database holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from steptally.service.domain.progress import StepStatus
from steptally.service.domain.run import RunSnapshot

_PER_RUN: tuple[tuple[str, str, Callable[[RunSnapshot], float | None]], ...] = (
    ("last_finalised_step", "Step number of the latest finalised step.", lambda r: r.last_step),
    (
        "last_finalised_revision",
        "Revision of the latest finalised step.",
        lambda r: r.last_revision if r.last_step is not None else None,
    ),
    (
        "last_step_complete",
        "1 when the latest finalised step is complete, 0 when partial.",
        lambda r: None if r.last_status is None else float(r.last_status is StepStatus.COMPLETE),
    ),
    ("open_steps", "Steps still waiting for ranks or fragments.", lambda r: r.open_steps),
    ("partial_steps", "Steps finalised as partial after their timeout.", lambda r: r.partial_steps),
    ("missing_ranks", "Ranks missing, summed over the partial steps.", lambda r: r.missing_ranks),
    ("world_size", "Ranks expected in every step.", lambda r: r.world_size),
)


class RunValueCollector(Collector):
    """Yields the latest value of every run and metric from ``snapshot()``."""

    def __init__(
        self,
        snapshot: Callable[[], Sequence[RunSnapshot]],
        window_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._snapshot = snapshot
        self._window_s = window_s
        self._clock = clock

    def _runs(self) -> list[RunSnapshot]:
        runs = list(self._snapshot())
        if self._window_s is None:
            return runs
        since = self._clock() - self._window_s
        return [r for r in runs if r.open_steps or r.active_at >= since]

    def describe(self) -> Iterable[Metric]:
        return []  # nothing known before the first scrape; never query at registration

    def collect(self) -> Iterable[Metric]:
        runs = self._runs()
        values = GaugeMetricFamily(
            "steptally_metric_value",
            "Latest finalised value of a run's metric or derived value.",
            labels=["run", "metric"],
        )
        for run in runs:
            for metric, value in sorted(run.values.items()):
                if value is not None:
                    values.add_metric([run.run, metric], value)
        yield values
        for name, doc, get in _PER_RUN:
            family = GaugeMetricFamily(f"steptally_{name}", doc, labels=["run"])
            for run in runs:
                value = get(run)
                if value is not None:
                    family.add_metric([run.run], float(value))
            yield family
        breaches = CounterMetricFamily(
            "steptally_alert_breaches",
            "Steps that broke an alert rule of the run, counted once per step and rule "
            "(every replica shows the same count: aggregate with max, not sum).",
            labels=["run", "rule"],
        )
        for run in runs:
            for rule, n in sorted(run.breaches.items()):
                breaches.add_metric([run.run, rule], float(n))
        yield breaches
        now = self._clock()
        age = GaugeMetricFamily(
            "steptally_oldest_open_step_age_seconds",
            "Seconds since the run's lowest open step was first seen.",
            labels=["run"],
        )
        missing = GaugeMetricFamily(
            "steptally_oldest_open_step_missing_ranks",
            "Ranks that have not committed the run's lowest open step.",
            labels=["run"],
        )
        for run in runs:
            if run.open_since is not None and run.open_missing_ranks is not None:
                age.add_metric([run.run], max(0.0, now - run.open_since))
                missing.add_metric([run.run], float(run.open_missing_ranks))
        yield age
        yield missing
