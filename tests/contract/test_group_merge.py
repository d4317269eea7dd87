"""A group of batches stored as one batch's statements answers exactly as the same
batches stored one by one, in the same order: outcomes, errors and every stored step.

Each scenario runs twice in one database, on two runs with the same spec: run ``g``
takes the batches as one group (:meth:`SqlStore._ingest_group`), run ``s`` one batch
at a time. Where merging would change an answer (a step finalised before a later
batch of the group touches it, a broken rule, two batches of one (step, rank)), the
group falls back to one savepoint per batch; each scenario also says which path it
expects, and whether PostgreSQL stores it in one round trip (nothing of its pairs
stored yet, none of its steps finalised: :func:`.sql_ingest.ingest_fresh`).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from steptally.client.algebra import MetricSpec
from steptally.client.wire import decode_batch
from steptally.service.domain.batch import PreparedBatch, prepare
from steptally.service.domain.run import RunDraft, RunRecord
from steptally.service.errors import ServiceError
from steptally.service.settings import Settings
from steptally.service.store import sql_ingest
from steptally.service.store.group_commit import Pending
from steptally.service.store.protocol import StepRecord
from steptally.service.store.sql import SqlStore

SPEC = MetricSpec.build({"a": "sum", "n": "count", "lo": "min"}, {"m": "a / n"})
T0 = 1_000.0
Frag = tuple[int, int, int, dict[str, Any]]
Body = tuple[list[Frag], list[tuple[int, int, int]]]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def sql_store(request: pytest.FixtureRequest) -> Iterator[SqlStore]:
    settings: Settings = request.getfixturevalue("settings_" + request.param)
    store = SqlStore.from_url(settings.database_url, group_max_batches=64)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def settings_sqlite(contract_sqlite_url: str) -> Settings:
    from tests.contract.conftest import _empty

    _empty(contract_sqlite_url)
    return Settings(database_url=contract_sqlite_url)


@pytest.fixture
def settings_postgres(contract_postgres_url: str) -> Settings:
    from tests.contract.conftest import _empty

    _empty(contract_postgres_url)
    return Settings(database_url=contract_postgres_url)


def _register(store: SqlStore, name: str, world_size: int) -> RunRecord:
    run, _ = store.register_run(name, lambda _: RunDraft(world_size, SPEC, 60.0), T0)
    return run


def _prepared(run: RunRecord, body: Body) -> PreparedBatch:
    frags, commits = body
    data = {
        "fragments": [{"step": s, "rank": r, "seq": q, "values": v} for s, r, q, v in frags],
        "commits": [{"step": s, "rank": r, "fragments": n} for s, r, n in commits],
    }
    return prepare(run, decode_batch(data), columnar=False)


def _answer(outcome: Any) -> tuple[Any, ...]:
    if isinstance(outcome, ServiceError):
        return (type(outcome).__name__, outcome.code, outcome.message, outcome.where)
    fin = [(f.step, f.status, f.revision, f.record.finalised_at) for f in outcome.finalised]
    return (outcome.accepted, outcome.duplicates, outcome.commits, fin)


def _steps(store: SqlStore, run: RunRecord) -> list[StepRecord]:
    current = store.get_run(run.name)
    assert current is not None
    return store.list_steps(current, None, None, 100)


def _compare(
    store: SqlStore,
    world_size: int,
    before: list[Body],
    group: list[Body],
    merged: bool,
    monkeypatch: pytest.MonkeyPatch,
    timeout: float | None = None,
    fresh: bool = False,
) -> list[tuple[Any, ...]]:
    """Store ``before`` one by one on both runs (then time out what is due at
    ``timeout``), then ``group``: as one group on ``g``, one by one on ``s``. Asserts
    equal answers and steps and the path taken (``fresh``: in one round trip, where
    the store can); returns the answers."""
    runs = {name: _register(store, name, world_size) for name in ("g", "s")}
    for run in runs.values():
        for i, body in enumerate(before):
            store.ingest(run, _prepared(run, body), T0 + 1 + i)
    if timeout is not None:
        assert len(store.sweep(timeout)) > 0
    took: list[bool] = []
    real = SqlStore._ingest_merged

    def spy(self: SqlStore, items: list[Pending]) -> bool:
        took.append(real(self, items))
        return took[-1]

    monkeypatch.setattr(SqlStore, "_ingest_merged", spy)
    one_trip: list[bool] = []
    real_fresh = sql_ingest.ingest_fresh

    def spy_fresh(*args: Any) -> list[sql_ingest.Stored] | None:
        stored = real_fresh(*args)
        one_trip.append(stored is not None)
        return stored

    start = T0 + 100
    items = [Pending(runs["g"], _prepared(runs["g"], b), start + i, 0) for i, b in enumerate(group)]
    monkeypatch.setattr(sql_ingest, "ingest_fresh", spy_fresh)
    store._ingest_group(items)
    monkeypatch.setattr(sql_ingest, "ingest_fresh", real_fresh)
    assert one_trip == [fresh and store.dialect.name == "postgresql"]
    grouped = [_answer(p.outcome if p.error is None else p.error) for p in items]
    assert all(p.outcome is not None or isinstance(p.error, ServiceError) for p in items)
    alone: list[tuple[Any, ...]] = []
    for i, body in enumerate(group):
        try:
            alone.append(_answer(store.ingest(runs["s"], _prepared(runs["s"], body), start + i)))
        except ServiceError as exc:
            alone.append(_answer(exc))
    assert grouped == alone
    assert took == [merged]
    # a step first seen in a group may be first seen at the group's earliest arrival
    new = {s for b, _ in group for s, *_ in b} - {s for b, _ in before for s, *_ in b}
    g_steps, s_steps = _steps(store, runs["g"]), _steps(store, runs["s"])
    for g, s in zip(g_steps, s_steps, strict=True):
        assert g.first_seen_at in ({start, s.first_seen_at} if g.step in new else {s.first_seen_at})
    assert [
        replace(g, first_seen_at=s.first_seen_at) for g, s in zip(g_steps, s_steps, strict=True)
    ] == s_steps
    return grouped


def _rank(step: int, rank: int, fragments: int = 2, commit: bool = True) -> Body:
    frags = [
        (step, rank, q, {"a": 0.1 * (rank + 1) + q, "n": rank + q + 1.0, "lo": -rank - q / 3})
        for q in range(fragments)
    ]
    return frags, [(step, rank, fragments)] if commit else []


def test_one_body_per_rank_is_one_batch(sql_store: SqlStore, monkeypatch: Any) -> None:
    group = [_rank(0, r) for r in range(4)]
    answers = _compare(sql_store, 4, [], group, merged=True, monkeypatch=monkeypatch, fresh=True)
    assert [a[3] for a in answers] == [[], [], [], [(0, "complete", 1, T0 + 103)]]


def test_fresh_ranks_of_two_steps_each_completed(sql_store: SqlStore, monkeypatch: Any) -> None:
    """Nothing of the group's pairs stored, one step open and one new: each step is
    finalised with the last batch that touches it."""
    group = [_rank(1, 0), _rank(0, 1), _rank(1, 1), _rank(2, 0, fragments=1)]
    answers = _compare(
        sql_store, 2, [_rank(0, 0)], group, merged=True, monkeypatch=monkeypatch, fresh=True
    )
    assert [[f[:2] for f in a[3]] for a in answers] == [
        [],
        [(0, "complete")],
        [(1, "complete")],
        [],
    ]


def test_a_fresh_group_with_a_broken_rule(sql_store: SqlStore, monkeypatch: Any) -> None:
    """Nothing of its pairs stored, but a commit that does not count a fragment sent:
    the group goes one batch at a time, and that batch alone is refused."""
    bad_count = ([(0, 2, 1, {"a": 1.0})], [(0, 2, 1)])
    answers = _compare(sql_store, 3, [], [_rank(0, 0), bad_count, _rank(0, 1)], False, monkeypatch)
    assert [a[1] if isinstance(a[1], str) else 0 for a in answers] == [0, "commit_conflict", 0]


def test_steps_completed_by_different_batches(sql_store: SqlStore, monkeypatch: Any) -> None:
    before = [_rank(0, 0), _rank(1, 1), _rank(2, 0, commit=False)]
    group = [_rank(0, 1), _rank(1, 0), _rank(2, 1), ([(2, 0, 2, {"a": 1e300})], [(2, 0, 3)])]
    answers = _compare(sql_store, 2, before, group, merged=True, monkeypatch=monkeypatch)
    assert [len(a[3]) for a in answers] == [1, 1, 0, 1]


def test_duplicates_in_a_group(sql_store: SqlStore, monkeypatch: Any) -> None:
    before = [_rank(0, 0, commit=False)]
    group = [_rank(0, 0), _rank(0, 1, fragments=3), _rank(0, 2)]
    answers = _compare(sql_store, 3, before, group, merged=True, monkeypatch=monkeypatch)
    assert answers[0][:3] == (0, 2, 1)


def test_a_step_completed_before_a_later_batch_of_the_group(
    sql_store: SqlStore, monkeypatch: Any
) -> None:
    before = [_rank(0, 0, fragments=1)]
    group = [_rank(0, 1), ([(0, 0, 1, {"a": 1.0})], []), _rank(1, 0)]
    answers = _compare(sql_store, 2, before, group, merged=False, monkeypatch=monkeypatch)
    assert answers[1][1] == "step_complete"


def test_a_partial_step_revised_by_two_batches(sql_store: SqlStore, monkeypatch: Any) -> None:
    answers = _compare(
        sql_store,
        3,
        [_rank(0, 0)],
        [_rank(0, 1), _rank(0, 2)],
        merged=False,
        monkeypatch=monkeypatch,
        timeout=T0 + 1 + 61,
    )
    assert [a[3][0][1:3] for a in answers] == [("partial", 2), ("complete", 3)]


def test_a_partial_step_revised_by_the_last_batch(sql_store: SqlStore, monkeypatch: Any) -> None:
    answers = _compare(
        sql_store,
        3,
        [_rank(0, 0), _rank(1, 0)],
        [_rank(1, 1), _rank(0, 2)],
        merged=True,
        monkeypatch=monkeypatch,
        timeout=T0 + 2 + 61,
    )
    assert [a[3][0][1:3] for a in answers] == [("partial", 2), ("partial", 2)]


def test_a_broken_rule_in_the_group(sql_store: SqlStore, monkeypatch: Any) -> None:
    before = [_rank(0, 0)]
    conflict = ([(0, 0, 0, {"a": 9.0, "n": 1.0, "lo": 0.0})], [])
    bad_count = ([(0, 2, 1, {"a": 1.0})], [(0, 2, 1)])
    group = [_rank(0, 1), conflict, bad_count, _rank(0, 3)]
    answers = _compare(sql_store, 4, before, group, merged=False, monkeypatch=monkeypatch)
    assert [a[1] if isinstance(a[1], str) else 0 for a in answers] == [
        0,
        "fragment_conflict",
        "commit_conflict",
        0,
    ]


def test_two_batches_of_one_rank(sql_store: SqlStore, monkeypatch: Any) -> None:
    group = [_rank(0, 0, commit=False), ([], [(0, 0, 2)]), _rank(0, 1)]
    answers = _compare(sql_store, 2, [], group, merged=False, monkeypatch=monkeypatch)
    assert answers[2][3][0][1:3] == ("complete", 1)


def test_a_group_the_event_loop_holds_goes_one_by_one_after_a_database_error(
    sql_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite's event loop stores a group holding the writer lock (``store_held``). An
    error of the database's own (here a disk I/O error, raised once by the group's
    write) drops the writer's connection; the group then goes one savepoint per batch
    on a new one, under the lock the loop holds, instead of waiting for that lock
    forever, and every batch is stored as it would be alone."""
    if sql_store.dialect.name != "sqlite":
        pytest.skip("the event loop stores SQLite's groups; PostgreSQL's has its own writer")
    run = _register(sql_store, "g", 2)
    items = [Pending(run, _prepared(run, _rank(0, r)), T0 + 1 + r, 0) for r in range(2)]
    failed: list[bool] = []
    real_fresh = sql_ingest.ingest_fresh

    def failing_once(*args: Any) -> list[sql_ingest.Stored] | None:
        if not failed:
            failed.append(True)
            raise sqlite3.OperationalError("disk I/O error")
        return real_fresh(*args)

    monkeypatch.setattr(sql_ingest, "ingest_fresh", failing_once)
    assert sql_store._writers.try_enter()  # as the loop does before store_held
    worker = threading.Thread(target=sql_store.store_held, args=(items,), daemon=True)
    try:
        worker.start()
        worker.join(10)
        assert not worker.is_alive(), "the group waits for the writer lock its caller holds"
    finally:
        sql_store._writers.__exit__(None, None, None)
    worker.join(10)
    assert failed == [True]
    assert [p.error for p in items] == [None, None]
    assert [_answer(p.outcome) for p in items] == [
        (2, 0, 1, []),
        (2, 0, 1, [(0, "complete", 1, T0 + 2)]),
    ]
    alone = _register(sql_store, "s", 2)
    for r in range(2):
        sql_store.ingest(alone, _prepared(alone, _rank(0, r)), T0 + 1 + r)
    assert _steps(sql_store, run) == _steps(sql_store, alone)  # the same step, exactly
