"""SQLite's plain write (:meth:`.SqliteDialect.store_fresh`), on a real database file: a
batch of plain pairs is written without a read, and a pair stored already or a step
finalised leaves everything as it was and hands the batch back to the probe's path."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from steptally.client.algebra import MetricSpec
from steptally.client.wire import decode_batch
from steptally.service.domain.batch import PreparedBatch, plain_of, prepare
from steptally.service.domain.partial import states_of
from steptally.service.domain.run import RunDraft, RunRecord
from steptally.service.domain.step import Delta
from steptally.service.store import sql_ingest
from steptally.service.store.dialect import SqliteDialect
from steptally.service.store.engine import transaction
from steptally.service.store.migration import upgrade
from steptally.service.store.sql import SqlStore

SPEC = MetricSpec.build({"a": "sum", "n": "count"}, {"m": "a / n"})
RANKS = 4
T0 = 1_000.0


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    url = f"sqlite:///{tmp_path / 'plain.sqlite3'}"
    upgrade(url)
    s = SqlStore.from_url(url)
    try:
        yield s
    finally:
        s.close()


def _run(store: SqlStore) -> RunRecord:
    run, _ = store.register_run("r", lambda _: RunDraft(RANKS, SPEC, 60.0), T0)
    return run


def _plain(run: RunRecord, pairs: list[tuple[int, int]]) -> PreparedBatch:
    """Each pair two fragments and its commit, as the service prepares a reporter's body."""
    frags = [
        {"step": s, "rank": r, "seq": q, "values": {"a": 0.5 + r + q, "n": 1.0}}
        for s, r in pairs
        for q in (0, 1)
    ]
    commits = [{"step": s, "rank": r, "fragments": 2} for s, r in pairs]
    batch = prepare(run, decode_batch({"fragments": frags, "commits": commits}), columnar=False)
    batch.states = states_of(run, batch.fragments)
    batch.set_plain(plain_of(batch.fragments, batch.commits))
    assert batch.is_plain()
    return batch


def _counts(store: SqlStore) -> tuple[Any, ...]:
    with store.engine.connect() as conn:
        return tuple(
            conn.exec_driver_sql(sql).all()
            for sql in (
                "SELECT step, status, committed_ranks, received, expected, missing_ranks "
                "FROM steps ORDER BY step",
                "SELECT step, rank, seq FROM fragments ORDER BY step, rank, seq",
                "SELECT step, rank, fragments FROM commits ORDER BY step, rank",
                "SELECT step, rank, fragments FROM partials ORDER BY step, rank",
            )
        )


def _fresh(store: SqlStore, run: RunRecord, batch: PreparedBatch, trace: list[str]) -> Any:
    """The dialect's plain write of ``batch`` in a write transaction of its own,
    committed; ``trace`` gets every statement it sent."""
    fresh = sql_ingest.fresh_write(run, [(batch, T0 + 1)])
    assert fresh is not None
    with transaction(store.engine, write=True) as conn:
        driver = conn.connection.driver_connection
        assert isinstance(driver, sqlite3.Connection)
        driver.set_trace_callback(trace.append)
        try:
            return store.dialect.store_fresh(conn, run, *fresh[:4])
        finally:
            driver.set_trace_callback(None)


def test_the_plain_write_reads_nothing_and_adds_to_an_open_step(store: SqlStore) -> None:
    assert isinstance(store.dialect, SqliteDialect)
    run = _run(store)
    trace: list[str] = []
    changed = _fresh(store, run, _plain(run, [(5, 0), (5, 1), (6, 0)]), trace)
    assert [(r.step, r.committed_ranks, r.received, r.missing_ranks) for r in changed] == [
        (5, 2, 4, RANKS - 2),
        (6, 1, 2, RANKS - 1),
    ]
    assert all(r.changed for r in changed)
    assert not [t for t in trace if t.lstrip().upper().startswith("SELECT")], trace
    assert [t.split()[0].upper() for t in trace] == [
        "SAVEPOINT", "INSERT", "INSERT", "INSERT", "INSERT", "RELEASE",
    ]  # fmt: skip
    # a later plain batch of the open step adds to its stored counters
    changed = _fresh(store, run, _plain(run, [(5, 3)]), [])
    assert [(r.step, r.committed_ranks, r.received, r.missing_ranks) for r in changed] == [
        (5, 3, 6, RANKS - 3)
    ]
    steps, frags, commits, partials = _counts(store)
    assert steps == [(5, "open", 3, 6, 6, 1), (6, "open", 1, 2, 2, 3)]
    assert frags == [(5, 0, 1), (5, 1, 1), (5, 3, 1), (6, 0, 1)]  # a bundle a pair
    assert commits == [(5, 0, 2), (5, 1, 2), (5, 3, 2), (6, 0, 2)]
    assert partials == commits


def test_a_stored_pair_or_a_finalised_step_writes_nothing(store: SqlStore) -> None:
    run = _run(store)
    assert _fresh(store, run, _plain(run, [(5, 0)]), []) is not None
    with store.engine.begin() as conn:  # (5, 1): a partial row and no commit
        conn.exec_driver_sql(
            "INSERT INTO partials (run_id, step, rank, fragments, state) "
            "VALUES (?, 5, 1, 1, x'00')",
            (run.id,),
        )
        conn.exec_driver_sql(
            "INSERT INTO steps (run_id, step, status, revision, committed_ranks, expected, "
            "received, missing_ranks, first_seen_at, deadline) "
            "VALUES (?, 7, 'partial', 1, 0, 0, 0, ?, 0, 60)",
            (run.id, RANKS),
        )
    before = _counts(store)
    for pairs in (
        [(5, 2), (5, 0)],  # (5, 0) has its commit stored, and its fragments
        [(5, 2), (5, 1)],  # (5, 1) has its partial row stored
        [(5, 2), (7, 0)],  # step 7 is finalised (partial)
        [(7, 0)],  # that step alone: no step row comes back
    ):
        trace: list[str] = []
        assert _fresh(store, run, _plain(run, pairs), trace) is None, pairs
        assert trace[-2:] == [
            "ROLLBACK TO SAVEPOINT steptally_fresh",
            "RELEASE SAVEPOINT steptally_fresh",
        ]
        assert _counts(store) == before, pairs


def test_a_group_that_completes_a_step_is_finalised_in_its_answer(store: SqlStore) -> None:
    """Through the store's writer: the plain write of a group, its step finalised inside
    the group's transaction, its exact value in the completing batch's outcome."""
    run = _run(store)
    outcomes = [store.ingest(run, _plain(run, [(9, r)]), T0 + 1) for r in range(RANKS - 1)]
    assert [o.finalised for o in outcomes] == [[]] * (RANKS - 1)
    last = store.ingest(run, _plain(run, [(9, RANKS - 1)]), T0 + 2)
    assert (last.accepted, last.duplicates, last.commits) == (2, 0, 1)
    [done] = last.finalised
    assert done.step == 9
    # a = sum over ranks r and seqs q of 0.5 + r + q; n = one a fragment
    a = sum(0.5 + r + q for r in range(RANKS) for q in (0, 1))
    step = store.get_step(run, 9)
    assert step is not None and step.result is not None
    metrics = step.result.metrics
    assert (step.status.value, metrics["a"]["value"]) == ("complete", a)
    assert metrics["m"]["value"] == a / metrics["n"]["value"]
    assert step.result.ranks_committed == list(range(RANKS))
    again = store.ingest(run, _plain(run, [(9, 0)]), T0 + 3)  # the probe's path says
    assert (again.accepted, again.duplicates, again.commits) == (0, 2, 0)


def test_the_fresh_write_hands_back_what_is_not_plain(store: SqlStore) -> None:
    run = _run(store)
    batch = _plain(run, [(5, 0)])
    batch.set_plain({})
    trace: list[str] = []
    with transaction(store.engine, write=True) as conn:
        driver = conn.connection.driver_connection
        assert isinstance(driver, sqlite3.Connection)
        driver.set_trace_callback(trace.append)
        assert store.dialect.store_fresh(conn, run, batch, {5: Delta(2, 1, 2)}, [], T0) is None
        driver.set_trace_callback(None)
    assert trace == []  # not a statement sent
    assert _counts(store)[0] == []
