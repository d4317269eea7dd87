"""The step rules of ``service/domain/step.py``: commit checks, counters, transitions
(pure, no database)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from steptally.client.algebra import MetricSpec
from steptally.client.wire import decode_batch
from steptally.service.domain import step as rules
from steptally.service.domain.batch import PreparedBatch, prepare
from steptally.service.domain.progress import Progress, StepStatus
from steptally.service.domain.run import RunRecord
from steptally.service.domain.step import Probe, StepState
from steptally.service.errors import CommitConflict, FragmentConflict, StepComplete

SPEC = MetricSpec.build({"a": "sum", "n": "count"}, {"m": "a / n"})
RUN = RunRecord(7, "r", 2, SPEC, 60.0, 0.0, ("a", "n"), ("m",))


def _batch(
    *frags: tuple[int, int, int, dict[str, object]],
    commits: list[tuple[int, int, int]] = (),  # type: ignore[assignment]
) -> PreparedBatch:
    body = {
        "fragments": [{"step": s, "rank": r, "seq": q, "values": v} for s, r, q, v in frags],
        "commits": [{"step": s, "rank": r, "fragments": n} for s, r, n in commits],
    }
    return prepare(RUN, decode_batch(body), columnar=False)


def _probe(batch: PreparedBatch, state: StepState | None = None, **known: Any) -> Probe:
    """A probe where everything of ``batch`` is new unless ``known`` says otherwise."""
    return Probe(
        steps={0: state or rules.opened(RUN, 0, 100.0)},
        new_frags=known.get("new_frags", list(batch.fragments)),
        new_commits=known.get("new_commits", list(batch.commits)),
        declared=known.get("declared", dict(batch.commits)),
        top_seq=known.get("top_seq", {}),
    )


def test_a_new_step_is_open_with_nothing_counted_and_due_after_the_timeout() -> None:
    state = rules.opened(RUN, 5, 100.0)
    assert state == StepState(
        step=5,
        status=StepStatus.OPEN,
        revision=0,
        committed_ranks=0,
        expected=0,
        received=0,
        missing_ranks=2,
        first_seen_at=100.0,
        deadline=160.0,
        finalised_at=None,
        result=None,
    )
    assert not rules.is_due(state, 159.999)
    assert rules.is_due(state, 160.0)
    state.status = StepStatus.PARTIAL
    assert not rules.is_due(state, 1e9)  # finalised steps are never due again


def test_duplicates_are_the_fragments_the_store_already_had() -> None:
    batch = _batch((0, 0, 0, {"a": 1.0, "n": 1}), (0, 0, 1, {"a": 2.0, "n": 1}))
    assert rules.duplicates(batch, _probe(batch)) == set()
    assert rules.duplicates(batch, _probe(batch, new_frags=[(0, 0, 1)])) == {(0, 0, 0)}


def test_a_duplicate_with_the_same_values_passes_and_with_other_values_conflicts() -> None:
    batch = _batch((0, 1, 3, {"a": 1.5, "n": 2}))
    values, present, tails = batch.fragments[(0, 1, 3)]
    same = [(0, 1, 3, values, present, tails), (0, 0, 3, b"x", None, None)]
    rules.check_duplicates(batch, {(0, 1, 3)}, same)  # the unrelated row is ignored
    other = _batch((0, 1, 3, {"a": 2.5, "n": 2})).fragments[(0, 1, 3)]
    with pytest.raises(FragmentConflict) as caught:
        rules.check_duplicates(batch, {(0, 1, 3)}, [(0, 1, 3, *other)])
    assert caught.value.where == "fragments[0]"
    assert caught.value.message == (
        "fragment step 0 rank 1 seq 3 was already received with different values; a "
        "fragment's values never change, so send a new seq or fix the sender"
    )


def test_no_new_fragment_joins_a_complete_step() -> None:
    batch = _batch((0, 1, 0, {"a": 1.0, "n": 1}))
    state = rules.opened(RUN, 0, 0.0)
    state.status = StepStatus.COMPLETE
    with pytest.raises(StepComplete) as caught:
        rules.check(batch, _probe(batch, state))
    assert caught.value.message == "step 0 is complete; rank 1 cannot add fragment 0 to it"
    state.status = StepStatus.PARTIAL
    rules.check(batch, _probe(batch, state))  # a partial step takes late fragments


def test_a_commit_is_final_but_may_be_repeated_alike() -> None:
    batch = _batch(commits=[(0, 1, 3)])
    rules.check(batch, _probe(batch, new_commits=[], declared={(0, 1): 3}))  # a duplicate
    with pytest.raises(CommitConflict) as caught:
        rules.check(batch, _probe(batch, new_commits=[], declared={(0, 1): 2}))
    assert caught.value.where == "commits[0]"
    assert caught.value.message == (
        "rank 1 already committed step 0 with 2 fragments, not 3; a commit is final"
    )


def test_a_fragment_beyond_the_declared_count_conflicts() -> None:
    batch = _batch((0, 0, 2, {"a": 1.0, "n": 1}))
    rules.check(batch, _probe(batch, declared={(0, 0): 3}))
    with pytest.raises(CommitConflict) as caught:
        rules.check(batch, _probe(batch, declared={(0, 0): 2}))
    assert caught.value.message == (
        "rank 0 committed step 0 with 2 fragments, so seq 2 cannot exist; seq counts from 0 "
        "to fragments-1"
    )


def test_a_commit_must_count_every_fragment_sent() -> None:
    batch = _batch(commits=[(0, 0, 2)])
    rules.check(batch, _probe(batch, top_seq={(0, 0): 1}))
    with pytest.raises(CommitConflict) as caught:
        rules.check(batch, _probe(batch, top_seq={(0, 0): 2}))
    assert caught.value.message == (
        "rank 0 commits step 0 with 2 fragments, but fragment seq 2 arrived; count every "
        "fragment sent"
    )


def test_counters_add_new_fragments_and_commits() -> None:
    steps = {0: rules.opened(RUN, 0, 0.0), 1: rules.opened(RUN, 1, 0.0)}
    rules.count(steps, [(0, 0, 0), (0, 0, 1), (0, 1, 0)], {(0, 0): 2, (0, 1): 4})
    s0, s1 = steps[0], steps[1]
    assert (s0.received, s0.committed_ranks, s0.expected, s0.missing_ranks) == (3, 2, 6, 0)
    assert s0.changed
    assert (s1.received, s1.committed_ranks, s1.expected, s1.missing_ranks) == (0, 0, 0, 2)
    assert not s1.changed


def _counted(status: StepStatus, committed: int, expected: int, received: int) -> StepState:
    state = rules.opened(RUN, 0, 0.0)
    state.status, state.changed = status, True
    state.committed_ranks, state.expected, state.received = committed, expected, received
    return state


@pytest.mark.parametrize(
    ("status", "committed", "expected", "received", "next_status"),
    [
        (StepStatus.OPEN, 2, 3, 3, StepStatus.COMPLETE),
        (StepStatus.OPEN, 2, 3, 2, None),  # a declared fragment is still missing
        (StepStatus.OPEN, 1, 3, 3, None),  # a rank has not committed
        (StepStatus.PARTIAL, 2, 3, 3, StepStatus.COMPLETE),  # the late rank completed it
        (StepStatus.PARTIAL, 1, 2, 2, StepStatus.PARTIAL),  # a new revision, still partial
        (StepStatus.COMPLETE, 2, 3, 3, None),
    ],
)
def test_next_status(
    status: StepStatus, committed: int, expected: int, received: int, next_status: Any
) -> None:
    state = _counted(status, committed, expected, received)
    assert rules.next_status(2, state) is next_status
    state.changed = False
    assert rules.next_status(2, state) is None  # an untouched step is left alone


def test_finalise_evaluates_bumps_the_revision_and_keeps_late_ranks() -> None:
    batch = _batch((0, 0, 0, {"a": 1.5, "n": 2}), (0, 1, 0, {"a": 4.0, "n": 1}))
    cells = list(batch.fragments.values())
    state = rules.opened(RUN, 0, 10.0)
    first = Progress(2, {0: 1}, {0: 1, 1: 1})
    result = rules.finalise(RUN, state, first, cells, None, 70.0)
    assert (state.status, state.revision, state.finalised_at) == (StepStatus.PARTIAL, 1, 70.0)
    assert (state.missing_ranks, state.changed) == (1, True)
    assert result.ranks_missing == [1] and result.ranks_late == []
    assert result.metrics["a"]["value"] == 5.5
    assert result.metrics["m"]["value"] == 5.5 / 3
    assert orjson.loads(state.result or "null") == result.to_json()
    assert state.values == [(0, 5.5, 0), (1, 3.0, 0), (-1, 5.5 / 3, 0)]

    late = Progress(2, {0: 1, 1: 1}, {0: 1, 1: 1})
    again = rules.finalise(RUN, state, late, cells, StepStatus.COMPLETE, 80.0)
    assert (state.status, state.revision, state.finalised_at) == (StepStatus.COMPLETE, 2, 80.0)
    assert state.missing_ranks == 0
    assert again.ranks_late == [1]
