"""A step's rules, whatever store holds it (pure: no SQL, no I/O).

A store keeps, per step, a :class:`StepState`: its status and revision and the
counters that say how far it is (ranks committed, fragments expected and received),
so that completeness is known without reading fragments. An ingest runs, under the
locks of the batch's steps:

1. the store inserts the batch's new fragments and commits and reads back what the
   checks need: a :class:`Probe`;
2. :func:`duplicates` names the fragments that were already stored; a duplicate must
   have the same values (:func:`check_duplicates`), else it is a conflict;
3. :func:`check` applies the commit rules (nothing is added to a complete step, a
   commit is final, a commit counts every fragment of its rank);
4. :func:`count` moves the counters; :func:`next_status` says which steps are
   finalised now and as what; :func:`finalise` evaluates one and bumps its revision.

Any error raises before the store writes anything, so a batch is all or nothing.
A store times out a step with :func:`is_due`; new steps start as :func:`opened`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from steptally.client.algebra.alerts import History
from steptally.client.wire import encode_number
from steptally.service.domain import finalise as evaluation
from steptally.service.domain.batch import CommitKey, FragmentKey, PreparedBatch
from steptally.service.domain.progress import Progress, StepStatus, is_complete
from steptally.service.domain.run import RunRecord
from steptally.service.errors import CommitConflict, FragmentConflict, StepComplete


@dataclass(slots=True)
class StepState:
    """One step as a store holds it, changed in memory and written back once.

    ``result`` is the stored JSON of the latest finalisation (None while never
    finalised); ``values`` the per-metric values to store when it was just finalised,
    and ``breaches`` the alert rules that finalisation broke.
    """

    step: int
    status: StepStatus
    revision: int
    committed_ranks: int
    expected: int
    received: int
    missing_ranks: int
    first_seen_at: float
    deadline: float
    finalised_at: float | None
    result: str | None
    changed: bool = False
    values: list[evaluation.StoredValue] = field(default_factory=list)
    breaches: list[dict[str, Any]] = field(default_factory=list)


def opened(run: RunRecord, step: int, now: float) -> StepState:
    """A step first seen at ``now``: open, nothing committed, due after the run's timeout."""
    return StepState(
        step=step,
        status=StepStatus.OPEN,
        revision=0,
        committed_ranks=0,
        expected=0,
        received=0,
        missing_ranks=run.world_size,
        first_seen_at=now,
        deadline=now + run.step_timeout_s,
        finalised_at=None,
        result=None,
    )


def is_due(state: StepState, now: float) -> bool:
    """Whether a step is still open and past its deadline at ``now`` (to time it out)."""
    return state.status is StepStatus.OPEN and state.deadline <= now


@dataclass(slots=True)
class Probe:
    """What a batch's transaction knows once it holds the batch's (step, rank) pairs.

    ``steps`` are the batch's steps as read (a step not stored yet as :func:`opened`);
    ``new_frags`` and ``new_commits`` the keys that were not stored before; ``declared``
    holds the stored commits (new or old) that the checks need, by (step, rank);
    ``top_seq`` the highest stored ``seq`` of each newly committing pair (this batch's
    fragments included); ``partials`` the stored partial rows (fragments, state) of the
    batch's pairs, a pair with none left out.
    """

    steps: dict[int, StepState]
    new_frags: list[FragmentKey]
    new_commits: list[CommitKey]
    declared: dict[CommitKey, int]
    top_seq: dict[CommitKey, int]
    partials: dict[CommitKey, tuple[int, bytes]] = field(default_factory=dict)


def probe_from(
    run: RunRecord,
    batch: PreparedBatch,
    now: float,
    steps: dict[int, StepState],
    stored: set[FragmentKey],
    commits: Mapping[CommitKey, int],
    partials: dict[CommitKey, tuple[int, bytes]],
) -> Probe:
    """The :class:`Probe` of ``batch`` from what a store read while it held the batch's
    pairs: the stored rows of its ``steps`` (a step not among them is new at ``now``),
    the stored fragment keys and commits of its pairs, and their partial rows."""
    for s in batch.steps():
        if s not in steps:
            steps[s] = opened(run, s, now)
    if not stored and not commits and batch.is_plain():  # every fragment and commit new
        top = {pair: n - 1 for pair, (n, _) in batch.plain.items()}
        new = dict(batch.commits)
        return Probe(steps, list(batch.fragments), list(new), new, top, partials)
    new_frags = [k for k in batch.fragments if k not in stored]
    new_commits = [k for k in batch.commits if k not in commits]
    declared = {**commits, **{k: batch.commits[k] for k in new_commits}}
    fresh = set(new_commits)
    top_seq: dict[CommitKey, int] = {}
    for s, r, q in (*stored, *batch.fragments):
        if (s, r) in fresh and q > top_seq.get((s, r), -1):
            top_seq[(s, r)] = q
    return Probe(steps, new_frags, new_commits, declared, top_seq, partials)


def duplicates(batch: PreparedBatch, probe: Probe) -> set[FragmentKey]:
    """The batch's fragments that were stored before (empty when every one is new)."""
    if len(probe.new_frags) == len(batch.fragments):
        return set()
    return set(batch.fragments) - set(probe.new_frags)


StoredFragment = tuple[int, int, int, bytes, bytes | None, bytes | None]


def check_duplicates(
    batch: PreparedBatch, collided: set[FragmentKey], stored: Iterable[StoredFragment]
) -> None:
    """A fragment sent again must carry the values stored: ``stored`` holds at least
    the rows of ``collided`` as ``(step, rank, seq, values, present, tails)``."""
    for s, r, q, values, present, tails in stored:
        key = (s, r, q)
        if key in collided and batch.fragments[key] != (values, present, tails):
            raise FragmentConflict(
                f"fragment step {s} rank {r} seq {q} was already received with different "
                "values; a fragment's values never change, so send a new seq or fix the sender",
                batch.where(key),
            )


def all_new(batch: PreparedBatch, probe: Probe) -> bool:
    """Whether ``batch`` is plain (:meth:`~.batch.PreparedBatch.is_plain`) and every
    fragment and commit of it new: then its rules and counters go a pair at a time."""
    return (
        len(probe.new_frags) == len(batch.fragments)
        and len(probe.new_commits) == len(batch.commits)
        and batch.is_plain()
    )


def _plain_passes(batch: PreparedBatch, probe: Probe) -> bool:
    """:func:`check` of a batch for which :func:`all_new` holds, a pair at a time: each
    commit is new, and each new fragment's seq below its own commit's count, so what
    is left is a step that is complete, or a stored fragment of a pair at or above the
    count its new commit declares. False: one of them is broken (or may be)."""
    steps, top = probe.steps, probe.top_seq
    for pair, (n, _) in batch.plain.items():
        if steps[pair[0]].status is StepStatus.COMPLETE:
            return False
        seq = top.get(pair)
        if seq is not None and seq >= n:
            return False
    return True


def check(batch: PreparedBatch, probe: Probe) -> None:
    """The commit rules, in this order: no new fragment joins a complete step; a commit
    stored before declares the same count again; a new fragment of a committed rank has
    ``seq`` below the count; a new commit counts every fragment its rank sent."""
    if all_new(batch, probe) and _plain_passes(batch, probe):
        return
    for frag in probe.new_frags:
        if probe.steps[frag[0]].status is StepStatus.COMPLETE:
            raise StepComplete(
                f"step {frag[0]} is complete; rank {frag[1]} cannot add fragment {frag[2]} to it",
                batch.where(frag),
            )
    fresh = set(probe.new_commits)
    for pair, n in batch.commits.items():
        stored = probe.declared.get(pair)
        if pair not in fresh and stored is not None and stored != n:
            raise CommitConflict(
                f"rank {pair[1]} already committed step {pair[0]} with {stored} fragments, "
                f"not {n}; a commit is final",
                batch.commit_where(pair),
            )
    for s, r, q in probe.new_frags:
        declared = probe.declared.get((s, r))
        if declared is not None and q >= declared:
            raise CommitConflict(
                f"rank {r} committed step {s} with {declared} fragments, so seq {q} cannot "
                "exist; seq counts from 0 to fragments-1",
                batch.where((s, r, q)),
            )
    for pair in probe.new_commits:
        top, n = probe.top_seq.get(pair), batch.commits[pair]
        if top is not None and top >= n:
            raise CommitConflict(
                f"rank {pair[1]} commits step {pair[0]} with {n} fragments, but fragment seq "
                f"{top} arrived; count every fragment sent",
                batch.commit_where(pair),
            )


@dataclass(slots=True)
class Delta:
    """What a batch added to one step's counters."""

    received: int = 0
    committed: int = 0
    expected: int = 0


def count(
    steps: Mapping[int, StepState],
    new_frags: Iterable[FragmentKey],
    new_commits: Mapping[CommitKey, int],
) -> dict[int, Delta]:
    """Add the new fragments and commits (with their declared counts) to the counters;
    returns what was added, per step."""
    added: defaultdict[int, Delta] = defaultdict(Delta)
    for s, n in Counter(k[0] for k in new_frags).items():
        steps[s].received += n
        steps[s].changed = True
        added[s].received += n
    per_step: defaultdict[int, list[int]] = defaultdict(list)
    for (s, _), n in new_commits.items():
        per_step[s].append(n)
    for s, counts in per_step.items():
        state = steps[s]
        state.committed_ranks += len(counts)
        state.expected += sum(counts)
        state.missing_ranks -= len(counts)
        state.changed = True
        added[s].committed += len(counts)
        added[s].expected += sum(counts)
    return dict(added)


def counted(batch: PreparedBatch, probe: Probe) -> dict[int, Delta]:
    """:func:`count` of ``probe``'s new fragments and commits of ``batch``; a pair at a
    time where :func:`all_new` holds (the same counters, the same steps in the same
    order)."""
    if not all_new(batch, probe):
        commits = batch.commits
        return count(probe.steps, probe.new_frags, {k: commits[k] for k in probe.new_commits})
    added: dict[int, Delta] = {}
    steps = probe.steps
    for (s, _), (n, _) in batch.plain.items():
        state = steps[s]
        state.received += n
        state.committed_ranks += 1
        state.expected += n
        state.missing_ranks -= 1
        state.changed = True
        delta = added.get(s)
        if delta is None:
            added[s] = Delta(n, 1, n)
        else:
            delta.received += n
            delta.committed += 1
            delta.expected += n
    return added


def next_status(world_size: int, state: StepState) -> StepStatus | None:
    """The status a step is finalised as after a batch changed it; None: not now.

    An open step is finalised once complete. A partial step is finalised again on
    any change: complete if that completed it, else partial again (a new revision).
    A complete step never changes.
    """
    if not state.changed or state.status is StepStatus.COMPLETE:
        return None
    done = is_complete(world_size, state.committed_ranks, state.received, state.expected)
    if done:
        return StepStatus.COMPLETE
    return StepStatus.PARTIAL if state.status is StepStatus.PARTIAL else None


def finalise(
    run: RunRecord,
    state: StepState,
    progress: Progress,
    cells: evaluation.Contributions,
    status: StepStatus | None,
    now: float,
    history: History = evaluation.no_history,
) -> evaluation.StepResult:
    """Evaluate a step from all of its fragments (or their merged partial state) as
    ``status`` (None: complete if it is, else partial) and make that its next revision,
    finalised at ``now``; ranks that committed since a partial finalisation are kept
    as late. The run's alert rules are checked against it once, ``history`` giving
    the earlier steps' values that change rules compare with."""
    status = status or evaluation.final_status(progress)
    previous = None
    if state.status is StepStatus.PARTIAL and state.result is not None:
        previous = evaluation.StepResult.from_json(orjson.loads(state.result))
    result = evaluation.with_late_ranks(evaluation.evaluate(run, progress, cells, status), previous)
    broken = [b.to_json(encode_number) for b in evaluation.breaches_of(run, result, history)]
    if broken:
        result = replace(result, breaches=broken)
    state.breaches = broken
    state.status = status
    state.revision += 1
    state.finalised_at = now
    state.result = orjson.dumps(result.to_json()).decode()
    state.missing_ranks = result.ranks_missing_count
    state.values = evaluation.stored_values(run, result)
    state.changed = True
    return result
