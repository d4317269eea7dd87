"""A batch's plain pairs (``batch.plain_of``): the rules, counters and rows a pair at a
time give exactly what the general path gives a fragment at a time, whatever the store
holds already — the same probe, the same error or none, the same counters, the same
partial and fragments rows."""

from __future__ import annotations

import copy
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steptally.client.algebra import MetricSpec
from steptally.client.wire import decode_batch
from steptally.service.domain import partial
from steptally.service.domain import step as rules
from steptally.service.domain.batch import PreparedBatch, plain_of, prepare
from steptally.service.domain.progress import StepStatus
from steptally.service.domain.run import RunRecord
from steptally.service.domain.step import Probe, StepState
from steptally.service.errors import ServiceError
from steptally.service.store.sql_ingest import partial_rows
from steptally.service.store.sql_step import fragment_rows

SPEC = MetricSpec.build({"a": "sum", "n": "count"}, {"m": "a / n"})
WORLD = 3
RUN = RunRecord(7, "r", WORLD, SPEC, 60.0, 0.0, ("a", "n"), ("m",))
NOW = 100.0


def _f64(*xs: float) -> bytes:
    return struct.pack(f"<{len(xs)}d", *xs)


def _cell(*xs: float) -> tuple[bytes, None, None]:
    return (_f64(*xs), None, None)


@pytest.mark.parametrize(
    ("fragments", "commits", "plain"),
    [
        # seqs 0..n-1, committed with n: plain, values in seq order whatever the order sent
        ({(0, 1, 1): _cell(2, 1), (0, 1, 0): _cell(1, 1)}, {(0, 1): 2}, {(0, 1): 2}),
        ({(4, 0, 0): _cell(5, 1)}, {(4, 0): 1}, {(4, 0): 1}),
        # not committed here, committed with another count, a seq missing, a mask, tails
        ({(0, 1, 0): _cell(1, 1)}, {}, {}),
        ({(0, 1, 0): _cell(1, 1)}, {(0, 1): 2}, {}),
        ({(0, 1, 0): _cell(1, 1), (0, 1, 2): _cell(1, 1)}, {(0, 1): 2}, {}),
        ({(0, 1, 0): (_f64(1, 1), b"\x01\x00", None)}, {(0, 1): 1}, {}),
        ({(0, 1, 0): (_f64(1, 1), None, b"\x00")}, {(0, 1): 1}, {}),
        # a commit of no fragments has no fragments to bundle: not plain
        ({}, {(0, 1): 0}, {}),
        # one pair plain, the other not
        (
            {(0, 0, 0): _cell(1, 1), (0, 1, 1): _cell(1, 1)},
            {(0, 0): 1, (0, 1): 2},
            {(0, 0): 1},
        ),
    ],
)
def test_plain_pairs_are_those_committed_whole_with_seqs_from_zero(
    fragments: dict[Any, Any], commits: dict[Any, int], plain: dict[Any, int]
) -> None:
    found = plain_of(fragments, commits)
    assert {pair: n for pair, (n, _) in found.items()} == plain
    for (s, r), (n, values) in found.items():
        assert values == b"".join(fragments[(s, r, q)][0] for q in range(n))


def test_a_batch_is_plain_only_while_every_pair_is_and_nothing_was_left_out() -> None:
    batch = _prepared({(0, 0): 2, (0, 1): 1}, {})
    assert batch.is_plain()
    assert batch.pairs() == {(0, 0), (0, 1)} and batch.steps() == [0]
    batch.fragments.pop((0, 0, 1))
    assert not batch.is_plain()
    assert batch.pairs() == {(0, 0), (0, 1)}


def _prepared(pairs: dict[tuple[int, int], int], odd: dict[str, Any]) -> PreparedBatch:
    """A batch of ``pairs`` (each ``n`` fragments, seqs 0 to n - 1, and its commit of n),
    then ``odd``: a pair's commit count changed or left out, an extra fragment."""
    frags = [
        {"step": s, "rank": r, "seq": q, "values": {"a": 0.5 * q - r, "n": 1.0 + s}}
        for (s, r), n in pairs.items()
        for q in range(n)
    ]
    commits = [{"step": s, "rank": r, "fragments": n} for (s, r), n in pairs.items()]
    for s, r, q in odd.get("extra", []):
        if any((f["step"], f["rank"], f["seq"]) == (s, r, q) for f in frags):
            continue
        frags.append({"step": s, "rank": r, "seq": q, "values": {"a": 0.25, "n": 2.0}})
    for i, n in odd.get("recount", {}).items():
        commits[i % len(commits)]["fragments"] = n
    if odd.get("uncommit") and commits:
        commits.pop()
    batch = prepare(RUN, decode_batch({"fragments": frags, "commits": commits}), columnar=False)
    batch.states = partial.states_of(RUN, batch.fragments)
    batch.set_plain(plain_of(batch.fragments, batch.commits))
    return batch


FRAGMENT = (st.integers(0, 2), st.integers(0, WORLD - 1), st.integers(0, 4))
KEY = st.tuples(*FRAGMENT[:2])


@st.composite
def cases(draw: st.DrawFn) -> tuple[PreparedBatch, dict[str, Any]]:
    """A batch (mostly plain) and what a store holds already of its steps and pairs."""
    pairs = draw(st.dictionaries(KEY, st.integers(1, 3), min_size=1, max_size=4))
    odd: dict[str, Any] = {}
    if draw(st.booleans()) and draw(st.booleans()):
        odd = draw(
            st.fixed_dictionaries(
                {},
                optional={
                    "extra": st.lists(st.tuples(*FRAGMENT), max_size=2),
                    "recount": st.dictionaries(st.integers(0, 3), st.integers(0, 4), max_size=2),
                    "uncommit": st.booleans(),
                },
            )
        )
    batch = _prepared(pairs, odd)
    keys = sorted({k[:2] for k in batch.fragments} | set(batch.commits))
    stored_frags = draw(
        st.sets(st.sampled_from([(s, r, q) for s, r in keys for q in range(5)]), max_size=4)
    )
    stored_commits = draw(
        st.dictionaries(st.sampled_from(keys), st.integers(0, 4), max_size=2)
        if keys
        else st.just({})
    )
    stored_partials = {
        (s, r): (1, partial.states_of(RUN, {(s, r, 9): _cell(3.0, 1.0)})[(s, r)][1])
        for s, r in draw(st.sets(st.sampled_from(keys), max_size=2) if keys else st.just(set()))
    }
    steps: dict[int, StepState] = {}
    for s in draw(st.sets(st.sampled_from(sorted({k[0] for k in keys})), max_size=2)):
        state = rules.opened(RUN, s, NOW - 1)
        state.status = draw(st.sampled_from(list(StepStatus)))
        state.committed_ranks = draw(st.integers(0, WORLD))
        state.received = state.expected = draw(st.integers(0, 6))
        state.missing_ranks = WORLD - state.committed_ranks
        steps[s] = state
    # the common case is nothing of the batch stored: each kind left out half the time
    stored_frags = stored_frags if draw(st.booleans()) else set()
    stored_commits = stored_commits if draw(st.booleans()) else {}
    stored_partials = stored_partials if draw(st.booleans()) else {}
    held = {"frags": stored_frags, "commits": stored_commits, "partials": stored_partials}
    return batch, {**held, "steps": steps}


def _general(batch: PreparedBatch) -> PreparedBatch:
    out = copy.copy(batch)
    out.set_plain({})
    assert not out.is_plain() or not out.commits
    return out


def _outcome(batch: PreparedBatch, held: dict[str, Any]) -> dict[str, Any]:
    steps = copy.deepcopy(held["steps"])
    probe = rules.probe_from(
        RUN, batch, NOW, steps, set(held["frags"]), dict(held["commits"]), dict(held["partials"])
    )
    seen: dict[str, Any] = {
        "probe": (
            copy.deepcopy(probe.steps),
            probe.new_frags,
            probe.new_commits,
            list(probe.declared.items()),
            sorted(probe.top_seq.items()),
        )
    }
    try:
        rules.check(batch, probe)
        seen["error"] = None
    except ServiceError as exc:
        seen["error"] = (type(exc), exc.message, exc.where)
    deltas = rules.counted(batch, probe)
    seen["deltas"] = [(s, d.received, d.committed, d.expected) for s, d in deltas.items()]
    seen["steps"] = probe.steps
    seen["partials"] = partial_rows(RUN, batch, probe)
    seen["fragments"] = fragment_rows(RUN.id, batch, probe.new_frags)
    return seen


@settings(max_examples=1500, deadline=None)
@given(cases())
def test_plain_pairs_are_stored_as_the_general_path_stores_them(
    case: tuple[PreparedBatch, dict[str, Any]],
) -> None:
    batch, held = case
    assert _outcome(batch, held) == _outcome(_general(batch), held)


def test_the_reporters_batch_takes_the_plain_path_when_nothing_of_it_is_stored() -> None:
    batch = _prepared({(0, 0): 3, (0, 2): 1, (1, 0): 2}, {})
    probe = rules.probe_from(RUN, batch, NOW, {}, set(), {}, {})
    assert rules.all_new(batch, probe)
    rows = fragment_rows(RUN.id, batch, probe.new_frags)
    assert [row[1:4] + row[7:] for row in rows] == [
        (0, 0, 2, struct.pack("<3q", 0, 1, 2)),
        (0, 2, 0, None),
        (1, 0, 1, struct.pack("<2q", 0, 1)),
    ]
    # a pair stored before (its commit) sends every batch of it the general way
    probe = rules.probe_from(RUN, batch, NOW, {}, set(), {(0, 2): 1}, {})
    assert not rules.all_new(batch, probe)


def test_a_complete_step_or_a_stored_higher_seq_is_refused_as_before() -> None:
    batch = _prepared({(0, 0): 2}, {})
    done = rules.opened(RUN, 0, NOW)
    done.status = StepStatus.COMPLETE
    probe = rules.probe_from(RUN, batch, NOW, {0: done}, set(), {}, {})
    with pytest.raises(ServiceError, match="step 0 is complete"):
        rules.check(batch, probe)
    probe = Probe(
        {0: rules.opened(RUN, 0, NOW)}, list(batch.fragments), [(0, 0)], {(0, 0): 2}, {(0, 0): 4}
    )
    with pytest.raises(ServiceError, match="fragment seq 4 arrived"):
        rules.check(batch, probe)
