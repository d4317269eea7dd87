"""Large batches: on PostgreSQL a batch (or a merged group) of at least
``COPY_MIN_ROWS`` fragments is copied (binary ``COPY``) into a table of the session,
then inserted from it; everything else about it is the same as for a small batch,
alone, as duplicates, as a conflict, and inside a group that goes one savepoint per
batch (the copied rows of a batch rolled back never reach the next). SQLite runs the
same tests through its plain statements."""

from __future__ import annotations

from collections.abc import Iterator
from fractions import Fraction

import pytest

from steptally.client.algebra import MetricSpec
from steptally.client.wire import decode_batch
from steptally.service.domain.batch import PreparedBatch, prepare
from steptally.service.domain.run import RunDraft, RunRecord
from steptally.service.errors import FragmentConflict
from steptally.service.settings import Settings
from steptally.service.store.group_commit import Pending
from steptally.service.store.sql import SqlStore
from steptally.service.store.sql_postgres import COPY_MIN_ROWS
from tests.contract.conftest import _empty

SPEC = MetricSpec.build({"a": "sum", "n": "count"}, {})
T0 = 1_000.0
SEQS = 40
RANKS = (COPY_MIN_ROWS + SEQS - 1) // SEQS + 1  # enough for one rank fewer to be copied


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def sql_store(request: pytest.FixtureRequest) -> Iterator[SqlStore]:
    url: str = request.getfixturevalue(f"contract_{request.param}_url")
    _empty(url)
    store = SqlStore.from_url(Settings(database_url=url).database_url)
    try:
        yield store
    finally:
        store.close()


def _run(store: SqlStore, name: str = "big") -> RunRecord:
    run, _ = store.register_run(name, lambda _: RunDraft(RANKS, SPEC, 60.0), T0)
    return run


def _value(step: int, rank: int, seq: int) -> float:
    return (step + 1) * 0.1 + rank / 7 + seq / 3


def _batch(run: RunRecord, step: int, ranks: range, bump: float = 0.0) -> PreparedBatch:
    body = {
        "fragments": [
            {"step": step, "rank": r, "seq": q, "values": {"a": _value(step, r, q) + bump, "n": 1}}
            for r in ranks
            for q in range(SEQS)
        ],
        "commits": [{"step": step, "rank": r, "fragments": SEQS} for r in ranks],
    }
    return prepare(run, decode_batch(body), columnar=False)


def _exact(step: int) -> float:
    total = sum(
        (Fraction(_value(step, r, q)) for r in range(RANKS) for q in range(SEQS)), Fraction(0)
    )
    return float(total)


def test_a_large_batch_alone_then_again_then_changed(sql_store: SqlStore) -> None:
    run = _run(sql_store)
    batch = _batch(run, 0, range(RANKS))
    assert len(batch.fragments) >= COPY_MIN_ROWS
    done = sql_store.ingest(run, batch, T0 + 1)
    assert (done.accepted, done.duplicates, done.commits) == (RANKS * SEQS, 0, RANKS)
    assert [(f.step, f.status.value) for f in done.finalised] == [(0, "complete")]
    again = sql_store.ingest(run, _batch(run, 0, range(RANKS)), T0 + 2)
    assert (again.accepted, again.duplicates, again.commits, again.finalised) == (
        0,
        RANKS * SEQS,
        0,
        [],
    )
    with pytest.raises(FragmentConflict):
        sql_store.ingest(run, _batch(run, 0, range(RANKS), bump=1.0), T0 + 3)
    step = sql_store.get_step(run, 0)
    assert step is not None and step.result is not None
    assert step.result.metrics["a"]["value"] == _exact(0)
    assert step.result.metrics["n"]["value"] == RANKS * SEQS


def test_large_batches_in_a_group_that_goes_one_by_one(sql_store: SqlStore) -> None:
    run = _run(sql_store)
    sql_store.ingest(run, _batch(run, 1, range(1)), T0 + 1)  # rank 0 of step 1, stored
    group = [
        _batch(run, 0, range(RANKS - 1)),  # copied alone
        _batch(run, 1, range(RANKS), bump=1.0),  # copied, then a conflict: rolled back
        _batch(run, 1, range(1, RANKS)),  # copied after it: none of its rows
        _batch(run, 0, range(RANKS - 1, RANKS)),  # small: completes step 0
    ]
    items = [Pending(run, b, T0 + 10 + i, 0) for i, b in enumerate(group)]
    sql_store._ingest_group(items)
    assert isinstance(items[1].error, FragmentConflict)
    answers = [(p.outcome.accepted, p.outcome.duplicates) for p in items if p.outcome]
    assert answers == [((RANKS - 1) * SEQS, 0), ((RANKS - 1) * SEQS, 0), (SEQS, 0)]
    for s in (0, 1):
        step = sql_store.get_step(run, s)
        assert step is not None and step.result is not None
        assert (step.status.value, step.revision) == ("complete", 1)
        assert step.result.metrics["a"]["value"] == _exact(s)
