"""The Store Protocol's behaviour, through the seam the app uses (``open_store``), on
every store configuration: each test runs on SQLite, PostgreSQL and PostgreSQL with
Redis, and asserts the same exact values on each."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from steptally.client.algebra import MetricSpec
from steptally.client.wire import decode_batch
from steptally.service.coordination.store import CoordinatedStore
from steptally.service.domain.batch import PreparedBatch, plain_of, prepare
from steptally.service.domain.finalise import ValueState
from steptally.service.domain.partial import states_of
from steptally.service.domain.progress import Progress, StepStatus
from steptally.service.domain.run import RunDraft, RunRecord, RunSnapshot
from steptally.service.errors import CommitConflict, FragmentConflict, StepComplete
from steptally.service.settings import Settings
from steptally.service.store.protocol import (
    FinalisedStep,
    SeriesRows,
    Store,
)
from steptally.service.store.sql import SqlStore

SPEC = MetricSpec.build({"a": "sum", "n": "count"}, {"m": "a / n"})
T0 = 1_000.0  # registration; every step of a test is first seen at T0 + 1
TIMEOUT_S = 60.0


def _register(store: Store, name: str = "r", world_size: int = 2) -> RunRecord:
    run, created = store.register_run(
        name, lambda existing: RunDraft(world_size, SPEC, TIMEOUT_S), T0
    )
    assert created
    return run


_AS_SERVED = [False]


@pytest.fixture(autouse=True, params=["bare", "as served"])
def as_served(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test twice: its batches as :func:`prepare` makes them, and as the service
    hands them to the store (their pairs' partial states and plain pairs found, which
    take the stores' faster paths: on PostgreSQL, the plain fresh write)."""
    _AS_SERVED[0] = request.param == "as served"
    yield
    _AS_SERVED[0] = False


def _batch(
    run: RunRecord,
    frags: list[tuple[int, int, int, dict[str, float]]] = [],  # noqa: B006
    commits: list[tuple[int, int, int]] = [],  # noqa: B006
) -> PreparedBatch:
    body = {
        "fragments": [{"step": s, "rank": r, "seq": q, "values": v} for s, r, q, v in frags],
        "commits": [{"step": s, "rank": r, "fragments": n} for s, r, n in commits],
    }
    batch = prepare(run, decode_batch(body), columnar=False)
    if _AS_SERVED[0]:
        batch.states = states_of(run, batch.fragments)
        batch.set_plain(plain_of(batch.fragments, batch.commits))
    return batch


RANK0 = (0, 0, 0, {"a": 1.5, "n": 2.0})
RANK1 = (0, 1, 0, {"a": 2.25, "n": 1.0})


def _metric(value: float, kind: str, values: int) -> dict[str, Any]:
    return {"value": value, "reason": None, "kind": kind, "values": values, "non_finite": 0}


def _finalised(outcome: list[FinalisedStep]) -> list[tuple[Any, ...]]:
    return [(f.run, f.step, f.status, f.revision) for f in outcome]


def test_the_factory_builds_the_configured_store(store: Store, settings: Settings) -> None:
    if settings.redis_url is None:
        assert type(store) is SqlStore
    else:
        assert type(store) is CoordinatedStore
        assert type(store.sql) is SqlStore
    store.check_ready()  # migrated: ready


def test_register_creates_then_extends_a_run(store: Store) -> None:
    seen: list[RunRecord | None] = []

    def decide(existing: RunRecord | None) -> RunDraft:
        seen.append(existing)
        return RunDraft(2, SPEC, TIMEOUT_S)

    run, created = store.register_run("r", decide, T0)
    assert created
    assert (run.name, run.world_size, run.step_timeout_s, run.created_at) == ("r", 2, 60.0, T0)
    assert (run.columns, run.derived_columns) == (("a", "n"), ("m",))
    assert run.spec == SPEC
    more = MetricSpec.build({"a": "sum", "n": "count", "b": "max"}, {"m": "a / n"})
    again, created = store.register_run("r", lambda e: RunDraft(2, more, 30.0), T0 + 5)
    assert not created
    assert seen == [None]
    assert (again.id, again.created_at, again.step_timeout_s) == (run.id, T0, 30.0)
    assert again.columns == ("a", "n", "b")  # append-only: a new metric gets the next column
    assert store.get_run("r") == again
    assert store.get_run("other") is None


def test_a_step_is_finalised_with_its_run_as_it_stands_then(store: Store) -> None:
    run = _register(store)
    first = store.ingest(run, _batch(run, [RANK0, RANK1], [(0, 0, 1), (0, 1, 1)]), T0 + 1)
    assert _finalised(first.finalised) == [("r", 0, StepStatus.COMPLETE, 1)]
    more = MetricSpec.build({"a": "sum", "n": "count", "b": "max"}, {"m": "a / n"})
    run, _ = store.register_run("r", lambda e: RunDraft(2, more, TIMEOUT_S), T0 + 2)
    frags = [(1, 0, 0, {"a": 1.5, "n": 2.0, "b": 4.0}), (1, 1, 0, {"a": 2.25, "n": 1.0, "b": -1.0})]
    done = store.ingest(run, _batch(run, frags, [(1, 0, 1), (1, 1, 1)]), T0 + 3)
    assert _finalised(done.finalised) == [("r", 1, StepStatus.COMPLETE, 1)]
    step = store.get_step(run, 1)
    assert step is not None and step.result is not None
    # the metric registered after the run's last finalisation is evaluated too
    assert dict(step.result.metrics)["b"] == _metric(4.0, "max", 2)
    assert dict(step.result.metrics)["m"] == _metric(1.25, "derived", 0)


def test_runs_are_listed_in_name_order_with_their_counts(store: Store) -> None:
    for name in ("c", "a", "b"):
        _register(store, name)
    assert [s.run.name for s in store.list_runs()] == ["a", "b", "c"]
    assert [s.run.name for s in store.list_runs(after="a", limit=1)] == ["b"]
    summary = store.run_summary("b")
    assert summary is not None
    assert (summary.open, summary.complete, summary.partial) == (0, 0, 0)
    assert (summary.last_finalised_step, summary.last_finalised_at) == (None, None)
    assert store.run_summary("zzz") is None


def test_a_step_completes_when_every_rank_committed_all_its_fragments(store: Store) -> None:
    run = _register(store)
    first = store.ingest(run, _batch(run, [RANK0], [(0, 0, 1)]), T0 + 1)
    assert (first.accepted, first.duplicates, first.commits, first.finalised) == (1, 0, 1, [])
    step = store.get_step(run, 0)
    assert step is not None
    assert (step.status, step.revision, step.result) == (StepStatus.OPEN, 0, None)
    assert step.progress == Progress(2, {0: 1}, {0: 1})  # an open step read live
    assert len(step.fragments) == 1

    done = store.ingest(run, _batch(run, [RANK1], [(0, 1, 1)]), T0 + 2)
    assert (done.accepted, done.duplicates, done.commits) == (1, 0, 1)
    assert _finalised(done.finalised) == [("r", 0, StepStatus.COMPLETE, 1)]
    step = store.get_step(run, 0)
    assert step is not None and step.result is not None
    assert (step.status, step.revision) == (StepStatus.COMPLETE, 1)
    assert (step.first_seen_at, step.finalised_at) == (T0 + 1, T0 + 2)
    assert dict(step.result.metrics) == {
        "a": _metric(3.75, "sum", 2),
        "n": _metric(3.0, "count", 2),
        "m": _metric(1.25, "derived", 0),
    }
    assert (step.result.ranks_committed, step.result.ranks_missing) == ([0, 1], [])
    assert (step.result.received, step.result.expected, step.result.ranks_late) == (2, 2, [])
    summary = store.run_summary("r")
    assert summary is not None
    assert (summary.open, summary.complete, summary.partial) == (0, 1, 0)
    assert (summary.last_finalised_step, summary.last_finalised_at) == (0, T0 + 2)


def test_an_empty_batch_is_stored_as_nothing(store: Store) -> None:
    run = _register(store)
    outcome = store.ingest(run, _batch(run), T0 + 1)
    assert (outcome.accepted, outcome.duplicates, outcome.commits, outcome.finalised) == (
        0,
        0,
        0,
        [],
    )
    assert store.list_steps(run, None, None, 10) == []


def test_a_batch_sent_again_is_all_duplicates_and_changes_nothing(store: Store) -> None:
    run = _register(store)
    batch = _batch(run, [RANK0, RANK1], [(0, 0, 1), (0, 1, 1)])
    assert store.ingest(run, batch, T0 + 1).accepted == 2
    again = store.ingest(run, batch, T0 + 9)
    assert (again.accepted, again.duplicates, again.commits, again.finalised) == (0, 2, 0, [])
    step = store.get_step(run, 0)
    assert step is not None and step.result is not None
    assert (step.revision, step.finalised_at, step.result.metrics["a"]["value"]) == (
        1,
        T0 + 1,
        3.75,
    )


def test_a_conflict_raises_and_stores_nothing_of_its_batch(store: Store) -> None:
    run = _register(store)
    store.ingest(run, _batch(run, [RANK0], [(0, 0, 1)]), T0 + 1)
    changed = (0, 0, 0, {"a": 9.0, "n": 2.0})
    with pytest.raises(FragmentConflict) as fragment:
        store.ingest(run, _batch(run, [RANK1, changed]), T0 + 2)
    assert fragment.value.where == "fragments[1]"
    with pytest.raises(CommitConflict) as commit:
        store.ingest(run, _batch(run, [RANK1], [(0, 0, 2)]), T0 + 2)
    assert commit.value.message == (
        "rank 0 already committed step 0 with 1 fragments, not 2; a commit is final"
    )
    with pytest.raises(CommitConflict):  # seq 1 of a rank that committed 1 fragment
        store.ingest(run, _batch(run, [(0, 0, 1, {"a": 1.0, "n": 1.0})]), T0 + 2)
    step = store.get_step(run, 0)
    assert step is not None
    assert step.progress == Progress(2, {0: 1}, {0: 1})  # rank 1's fragment is not there
    assert store.ingest(run, _batch(run, [RANK1], [(0, 1, 1)]), T0 + 3).accepted == 1


def test_nothing_joins_a_complete_step(store: Store) -> None:
    run = _register(store)
    store.ingest(run, _batch(run, [RANK0, RANK1], [(0, 0, 1), (0, 1, 1)]), T0 + 1)
    with pytest.raises(StepComplete) as caught:
        store.ingest(run, _batch(run, [(0, 1, 1, {"a": 1.0, "n": 1.0})]), T0 + 2)
    assert caught.value.message == "step 0 is complete; rank 1 cannot add fragment 1 to it"


def test_a_step_past_its_deadline_is_finalised_partial_then_revised(store: Store) -> None:
    run = _register(store)
    store.ingest(run, _batch(run, [RANK0], [(0, 0, 1)]), T0 + 1)
    assert store.sweep(T0 + 1 + TIMEOUT_S - 0.5) == []  # not yet due
    swept = store.sweep(T0 + 1 + TIMEOUT_S)
    assert _finalised(swept) == [("r", 0, StepStatus.PARTIAL, 1)]
    assert store.sweep(T0 + 1000) == []  # finalised once
    step = store.get_step(run, 0)
    assert step is not None and step.result is not None
    assert (step.status, step.revision, step.finalised_at) == (
        StepStatus.PARTIAL,
        1,
        T0 + 1 + TIMEOUT_S,
    )
    assert (step.result.ranks_committed, step.result.ranks_missing) == ([0], [1])
    assert step.result.metrics["a"]["value"] == 1.5
    snapshot = store.exposition_snapshot()
    assert snapshot == [
        RunSnapshot(
            run="r",
            world_size=2,
            last_step=0,
            last_status=StepStatus.PARTIAL,
            last_revision=1,
            values={"a": 1.5, "n": 2.0, "m": 0.75},
            open_steps=0,
            partial_steps=1,
            missing_ranks=1,
        )
    ]

    late = store.ingest(run, _batch(run, [RANK1], [(0, 1, 1)]), T0 + 100)
    assert _finalised(late.finalised) == [("r", 0, StepStatus.COMPLETE, 2)]
    step = store.get_step(run, 0)
    assert step is not None and step.result is not None
    assert (step.status, step.revision, step.finalised_at) == (StepStatus.COMPLETE, 2, T0 + 100)
    assert (step.result.ranks_missing, step.result.ranks_late) == ([], [1])
    assert step.result.metrics["m"]["value"] == 1.25


def test_a_partial_step_is_revised_by_each_late_fragment(store: Store) -> None:
    run = _register(store, world_size=3)
    store.ingest(run, _batch(run, [RANK0], [(0, 0, 1)]), T0 + 1)
    store.sweep(T0 + 1 + TIMEOUT_S)
    again = store.ingest(run, _batch(run, [RANK1], [(0, 1, 1)]), T0 + 70)
    assert _finalised(again.finalised) == [("r", 0, StepStatus.PARTIAL, 2)]
    step = store.get_step(run, 0)
    assert step is not None and step.result is not None
    assert (step.result.ranks_missing, step.result.ranks_late) == ([2], [1])
    assert step.result.metrics["a"]["value"] == 3.75


def test_reads_of_steps_in_order_and_finalised_since(store: Store) -> None:
    run = _register(store)
    for s, at in ((2, 5.0), (0, 3.0), (1, 4.0)):
        commits = [(s, 0, 1), (s, 1, 1)]
        frags = [(s, 0, 0, {"a": float(s), "n": 1.0}), (s, 1, 0, {"a": 0.5, "n": 1.0})]
        store.ingest(run, _batch(run, frags, commits), T0 + at)
    store.ingest(run, _batch(run, [(3, 0, 0, {"a": 1.0, "n": 1.0})]), T0 + 6)  # open
    assert [s.step for s in store.list_steps(run, None, None, 100)] == [0, 1, 2, 3]
    assert [s.step for s in store.list_steps(run, 1, 2, 100)] == [1, 2]
    assert [s.step for s in store.list_steps(run, 1, None, 2)] == [1, 2]
    open_step = store.list_steps(run, 3, 3, 1, live=False)[0]
    assert (open_step.status, open_step.progress, open_step.fragments) == (
        StepStatus.OPEN,
        None,
        (),
    )
    since = store.finalised_since(run, (T0 + 3.0, 0), 10)
    assert [(s.step, s.finalised_at) for s in since] == [(1, T0 + 4), (2, T0 + 5)]
    assert store.get_step(run, 99) is None


def test_a_series_is_the_finalised_values_of_a_column_in_step_order(store: Store) -> None:
    run = _register(store)
    for s in (0, 1, 2):
        frags = [(s, 0, 0, {"a": 1.0 + s, "n": 1.0}), (s, 1, 0, {"a": 0.25, "n": 1.0})]
        store.ingest(run, _batch(run, frags, [(s, 0, 1), (s, 1, 1)]), T0 + 1)
    store.ingest(run, _batch(run, [(3, 0, 0, {"a": 7.0, "n": 0.0})], [(3, 0, 1)]), T0 + 1)
    store.sweep(T0 + 1 + TIMEOUT_S)  # step 3 partial; its mean is 7 / 0
    assert store.series(run, run.value_column_of["a"], None, None, None) == SeriesRows(
        total=4,
        downsampled=False,
        steps=[0, 1, 2, 3],
        values=[1.25, 2.25, 3.25, 7.0],
        states=[ValueState.NUMBER] * 4,
        status=[StepStatus.COMPLETE] * 3 + [StepStatus.PARTIAL],
        revision=[1, 1, 1, 1],
    )
    mean = store.series(run, run.value_column_of["m"], 1, 3, None)
    assert (mean.steps, mean.values) == ([1, 2, 3], [1.125, 1.625, None])
    assert mean.states == [ValueState.NUMBER, ValueState.NUMBER, ValueState.UNDEFINED]
