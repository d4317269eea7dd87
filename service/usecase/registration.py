"""Register a run, and find registered runs (with a cache of their specs).

Registering the same spec again, or a superset that adds metrics or derived
expressions, is accepted; changing the world size, a metric's kind or a derived
expression's meaning is a :class:`SpecConflictError` naming every conflict. A
:class:`~steptally.service.auth.grant.Grant` short of ``ANY`` (an ingest token) may
not create a run, or may not change one, as it says: :class:`Forbidden`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from steptally.client.algebra import MetricSpec, SpecConflict, SpecError
from steptally.client.algebra.errors import AlertRuleError
from steptally.service.auth.grant import Grant
from steptally.service.domain.limits import RunLimits, brief
from steptally.service.domain.run import RunDraft, RunRecord, is_run_name
from steptally.service.errors import InvalidSpec, SpecConflictError, UnknownRun
from steptally.service.store.protocol import Store


@dataclass(frozen=True)
class RunRequest:
    name: str
    world_size: int
    metrics: Mapping[str, Any]
    derived: Mapping[str, str]
    step_timeout_s: float | None = None
    guards: Mapping[str, str] = field(default_factory=dict)
    limits: RunLimits = field(default_factory=RunLimits)
    alerts: Sequence[Mapping[str, Any]] = ()


def register(
    store: Store,
    request: RunRequest,
    default_timeout_s: float,
    now: float,
    grant: Grant = Grant.ANY,
) -> tuple[RunRecord, bool]:
    """Create or extend a run; returns it and whether it was created."""
    grant.check_name(request.name)
    if not is_run_name(request.name):
        raise InvalidSpec(
            f"run name {brief(request.name)} is invalid: use letters, digits, '_', '.' and '-', "
            "starting with a letter or digit, at most 128 characters",
            "name",
        )
    request.limits.check(request.world_size, request.step_timeout_s)
    try:
        spec = MetricSpec.build(
            request.metrics, request.derived, request.guards, request.limits.spec, request.alerts
        )
    except AlertRuleError as exc:
        raise InvalidSpec(str(exc), "alerts") from None
    except SpecError as exc:
        raise InvalidSpec(str(exc), "metrics") from None

    def decide(existing: RunRecord | None) -> RunDraft:
        if existing is None:
            grant.check_create(request.name)
            return RunDraft(request.world_size, spec, request.step_timeout_s or default_timeout_s)
        draft = RunDraft(
            request.world_size,
            _merge(existing, request, spec),
            request.step_timeout_s or existing.step_timeout_s,
        )
        grant.check_change(existing.name, _changes(existing, draft))
        return draft

    return store.register_run(request.name, decide, now)


def _changes(existing: RunRecord, draft: RunDraft) -> list[str]:
    """What ``draft`` would change in ``existing`` (its world size is checked apart)."""
    changes = []
    added = sorted(set(draft.spec.metrics) - set(existing.spec.metrics))
    added += sorted(set(draft.spec.derived) - set(existing.spec.derived))
    have = {r.name for r in existing.spec.alerts}
    rules = [r.name for r in draft.spec.alerts if r.name not in have]
    if added:
        changes.append(f"it would add {', '.join(added)}")
    if rules:
        changes.append(f"it would add alert rules {', '.join(rules)}")
    elif not added and draft.spec != existing.spec:
        changes.append("it would change the guards")
    if draft.step_timeout_s != existing.step_timeout_s:
        changes.append(
            f"step_timeout_s is {existing.step_timeout_s:g}, not {draft.step_timeout_s:g}"
        )
    return changes


def _merge(existing: RunRecord, request: RunRequest, spec: MetricSpec) -> MetricSpec:
    conflicts = []
    if existing.world_size != request.world_size:
        conflicts.append(
            f"world size is registered as {existing.world_size}, not {request.world_size}"
        )
    merged = existing.spec
    try:
        merged = existing.spec.merged_with(spec, request.limits.spec)
    except SpecConflict as exc:
        conflicts.extend(exc.conflicts)
    except SpecError as exc:
        raise InvalidSpec(str(exc), "metrics") from None
    if conflicts:
        raise SpecConflictError(
            f"run {existing.name!r} already exists and this spec conflicts with it: "
            f"{'; '.join(conflicts)}. Register under a new name to change them."
        )
    return merged


class RunDirectory:
    """Runs by name, cached in memory; the store stays the source of truth.

    A run's world size never changes and its metric columns only grow, so a cached
    run is refreshed when a batch names a metric it does not know yet.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._runs: dict[str, RunRecord] = {}
        self._lock = threading.Lock()

    def get(self, name: str, refresh: bool = False) -> RunRecord:
        run = None if refresh else self._runs.get(name)
        if run is None:
            run = self._store.get_run(name)
            if run is None:
                raise UnknownRun(
                    f"no run is named {brief(name)}; register it with POST /v1/runs first"
                )
            self.put(run)
        return run

    def cached(self, name: str) -> bool:
        """Whether :meth:`get` answers ``name`` from memory (without the store)."""
        return name in self._runs

    def put(self, run: RunRecord) -> None:
        with self._lock:
            self._runs[run.name] = run
