"""Alert rules checked at finalisation, on every store configuration: each revision of a
step is checked once, in the transaction that finalises it (ingest or sweep), its
breaches are in the stored step, and each (step, rule) is counted once."""

from __future__ import annotations

from typing import Any

from steptally.client.algebra import MetricSpec
from steptally.client.wire import decode_batch
from steptally.service.domain.batch import PreparedBatch, prepare
from steptally.service.domain.progress import StepStatus
from steptally.service.domain.run import RunDraft, RunRecord
from steptally.service.store.protocol import Store

T0 = 1_000.0
TIMEOUT_S = 60.0
RULES = [
    {"name": "m_high", "metric": "m", "above": 2.0},
    {"name": "m_jump", "metric": "m", "change_above": 1.0, "window": 2},
    {"name": "ranks", "missing_ranks_above": 0},
    {"name": "m_nan", "metric": "m", "non_finite": True},
]
SPEC = MetricSpec.build({"a": "sum", "n": "count"}, {"m": "a / n"}, alerts=RULES)


def _register(store: Store, world_size: int = 2) -> RunRecord:
    run, _ = store.register_run("r", lambda _: RunDraft(world_size, SPEC, TIMEOUT_S), T0)
    return run


def _batch(
    run: RunRecord, steps: dict[int, float], ranks: tuple[int, ...] = (0, 1)
) -> PreparedBatch:
    """Each rank of ``ranks`` sends a = value, n = 1 for each step and commits it, so the
    step's m is the value (both ranks send it)."""
    body = {
        "fragments": [
            {"step": s, "rank": r, "seq": 0, "values": {"a": v, "n": 1.0}}
            for s, v in steps.items()
            for r in ranks
        ],
        "commits": [{"step": s, "rank": r, "fragments": 1} for s in steps for r in ranks],
    }
    return prepare(run, decode_batch(body), columnar=False)


def _breaches(store: Store, run: RunRecord, step: int) -> list[dict[str, Any]]:
    record = store.get_step(run, step)
    assert record is not None and record.result is not None
    return record.result.breaches


def _counts(store: Store) -> dict[str, int]:
    (snap,) = store.exposition_snapshot()
    return dict(snap.breaches)


def test_every_rule_is_counted_from_zero(store: Store) -> None:
    _register(store)
    assert _counts(store) == {"m_high": 0, "m_jump": 0, "ranks": 0, "m_nan": 0}


def test_a_threshold_and_a_change_breach_in_the_finalising_ingest(store: Store) -> None:
    run = _register(store)
    store.ingest(run, _batch(run, {0: 1.0}), T0 + 1)
    store.ingest(run, _batch(run, {1: 1.5}), T0 + 2)
    assert _breaches(store, run, 0) == [] and _breaches(store, run, 1) == []
    # m = 3: above 2, and 1.75 from the mean of the last two (1.25) > 1
    store.ingest(run, _batch(run, {2: 3.0}), T0 + 3)
    assert _breaches(store, run, 2) == [
        {"rule": "m_high", "condition": "above", "metric": "m", "value": 3.0, "threshold": 2.0},
        {
            "rule": "m_jump",
            "condition": "change_above",
            "metric": "m",
            "value": 3.0,
            "threshold": 1.0,
            "mean": 1.25,
        },
    ]
    assert _counts(store) == {"m_high": 1, "m_jump": 1, "ranks": 0, "m_nan": 0}


def test_steps_finalised_in_one_transaction_see_each_other_in_a_window(store: Store) -> None:
    run = _register(store)
    store.ingest(run, _batch(run, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.75}), T0 + 1)
    # step 2's window is steps 0-1 (mean 1); step 3's is steps 1-2 (mean 1): 0.75 is within 1
    assert [_breaches(store, run, s) for s in range(4)] == [[], [], [], []]
    store.ingest(run, _batch(run, {4: 1.0, 5: 1.0, 6: -0.5}), T0 + 2)
    # 6: the mean of steps 4 and 5 (finalised in this same transaction, not yet written when
    # 6 was checked) is 1, and -0.5 is 1.5 off; steps 2 and 3 would have given 1.375
    assert [b["rule"] for b in _breaches(store, run, 6)] == ["m_jump"]
    assert _breaches(store, run, 6)[0]["mean"] == 1.0
    assert _breaches(store, run, 4) == _breaches(store, run, 5) == []


def test_a_swept_step_breaches_missing_ranks_once_across_its_revisions(store: Store) -> None:
    run = _register(store)
    store.ingest(run, _batch(run, {0: 2.5}, ranks=(0,)), T0 + 1)
    swept = store.sweep(T0 + 1 + TIMEOUT_S)
    assert [(f.step, f.status, f.revision) for f in swept] == [(0, StepStatus.PARTIAL, 1)]
    first = _breaches(store, run, 0)
    assert [b["rule"] for b in first] == ["m_high", "ranks"]
    assert first[1] == {
        "rule": "ranks",
        "condition": "missing_ranks_above",
        "metric": None,
        "value": 1.0,
        "threshold": 0,
    }
    # rank 1 arrives late: revision 2 is complete, still above 2, no rank missing
    store.ingest(run, _batch(run, {0: 2.5}, ranks=(1,)), T0 + 100)
    assert [b["rule"] for b in _breaches(store, run, 0)] == ["m_high"]
    # one breach per (step, rule): the second revision's m_high is not counted again
    assert _counts(store) == {"m_high": 1, "m_jump": 0, "ranks": 1, "m_nan": 0}


def test_a_non_finite_value_breaches_its_rule(store: Store) -> None:
    run = _register(store)
    store.ingest(run, _batch(run, {0: float("inf")}), T0 + 1)
    assert [(b["rule"], b["value"]) for b in _breaches(store, run, 0)] == [
        ("m_high", "Infinity"),
        ("m_nan", "Infinity"),
    ]


def test_a_run_without_rules_finalises_as_before(store: Store) -> None:
    plain = MetricSpec.build({"a": "sum", "n": "count"}, {"m": "a / n"})
    run, _ = store.register_run("p", lambda _: RunDraft(2, plain, TIMEOUT_S), T0)
    store.ingest(run, _batch(run, {0: 5.0}), T0 + 1)
    assert _breaches(store, run, 0) == []
    (snap,) = store.exposition_snapshot()
    assert snap.breaches == {}


def test_change_rules_on_several_metrics_read_their_own_windows(store: Store) -> None:
    rules = [
        {"name": "a_jump", "metric": "a", "change_above": 1.0, "window": 1},
        {"name": "m_jump", "metric": "m", "change_above": 1.0, "window": 3},
        {"name": "m_jump_wide", "metric": "m", "change_above": 0.5, "window": 4},
    ]
    spec = MetricSpec.build({"a": "sum", "n": "count"}, {"m": "a / n"}, alerts=rules)
    run, _ = store.register_run("w", lambda _: RunDraft(2, spec, TIMEOUT_S), T0)
    store.ingest(run, _batch(run, {0: 1.0, 1: 1.0, 2: 1.0}), T0 + 1)
    store.ingest(run, _batch(run, {3: 1.0, 4: 1.75}), T0 + 2)
    # step 4: a = 3.5 against step 3's 2 (1.5 off); m = 1.75 against the mean of steps 1-3
    # (1, 0.75 off: within 1) and of steps 0-3 (1, 0.75 off: over 0.5)
    found = {b["rule"]: b["mean"] for b in _breaches(store, run, 4)}
    assert found == {"a_jump": 2.0, "m_jump_wide": 1.0}
    assert _breaches(store, run, 3) == []  # m_jump_wide had 3 of its 4 steps: not checked


def test_a_rule_registered_while_a_step_is_open_is_checked_when_it_finalises(
    store: Store,
) -> None:
    # the batch that completes the step holds the run as it was read before the rule;
    # the finalisation reads the run as it stands (and parses it only when it changed)
    plain = MetricSpec.build({"a": "sum", "n": "count"}, {"m": "a / n"})
    run, _ = store.register_run("late", lambda _: RunDraft(2, plain, TIMEOUT_S), T0)
    held = run
    store.ingest(held, _batch(held, {0: 5.0}, ranks=(0,)), T0 + 1)
    ruled = MetricSpec.build(
        {"a": "sum", "n": "count"},
        {"m": "a / n", "double": "2 * a"},
        alerts=[{"name": "a_high", "metric": "a", "above": 1.0}],
    )
    store.register_run("late", lambda _: RunDraft(2, ruled, TIMEOUT_S), T0)
    done = store.ingest(held, _batch(held, {0: 5.0}, ranks=(1,)), T0 + 2)
    record = done.finalised[0].record
    assert record is not None and record.result is not None
    assert record.result.metrics["double"]["value"] == 20.0
    assert [b["rule"] for b in _breaches(store, held, 0)] == ["a_high"]
