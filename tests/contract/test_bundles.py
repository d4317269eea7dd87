"""Fragments that arrive together are one stored row (a bundle), and every rule holds
across bundles as it does across single rows: a fragment sent again in another split is
a duplicate, changed values are a conflict, a commit counts what the bundles hold, and
the step's values are exact — on every store configuration."""

from __future__ import annotations

from fractions import Fraction

import pytest
import sqlalchemy as sa

from steptally.client.algebra import MetricSpec
from steptally.client.wire import decode_batch
from steptally.service.domain.batch import PreparedBatch, prepare
from steptally.service.domain.run import RunDraft, RunRecord
from steptally.service.errors import CommitConflict, FragmentConflict
from steptally.service.settings import Settings
from steptally.service.store.factory import open_store
from steptally.service.store.protocol import Store

SPEC = MetricSpec.build({"a": "sum", "n": "count"}, {"m": "a / n"})
T0 = 1_000.0


def _value(rank: int, seq: int) -> float:
    return (rank + 1) * 1e16 + seq / 3 if seq % 2 else -(rank + 1) * 1e16 + seq / 7


def _batch(
    run: RunRecord, rank: int, seqs: range, commit: int | None = None, bump: float = 0.0
) -> PreparedBatch:
    body = {
        "fragments": [
            {"step": 0, "rank": rank, "seq": q, "values": {"a": _value(rank, q) + bump, "n": 1}}
            for q in seqs
        ],
        "commits": [] if commit is None else [{"step": 0, "rank": rank, "fragments": commit}],
    }
    return prepare(run, decode_batch(body), columnar=False)


def _rows(settings: Settings) -> list[tuple[int, int, int, bool]]:
    engine = sa.create_engine(settings.database_url)
    try:
        with engine.connect() as conn:
            return [
                (r, q, len(v), seqs is not None)
                for r, q, v, seqs in conn.exec_driver_sql(
                    "SELECT rank, seq, values_f64, seqs FROM fragments ORDER BY rank, seq"
                )
            ]
    finally:
        engine.dispose()


def test_a_body_is_one_row_and_every_rule_holds_across_rows(
    store: Store, settings: Settings
) -> None:
    run, _ = store.register_run("r", lambda _: RunDraft(2, SPEC, 60.0), T0)
    first = store.ingest(run, _batch(run, 0, range(0, 4)), T0 + 1)
    assert (first.accepted, first.duplicates) == (4, 0)
    # seqs 2 and 3 again, inside a bundle stored as one row: duplicates; 4 and 5 new
    again = store.ingest(run, _batch(run, 0, range(2, 6)), T0 + 2)
    assert (again.accepted, again.duplicates) == (2, 2)
    with pytest.raises(FragmentConflict, match="seq 1 was already received"):
        store.ingest(run, _batch(run, 0, range(1, 2), bump=1e3), T0 + 3)
    with pytest.raises(CommitConflict, match="fragment seq 5 arrived"):
        store.ingest(run, _batch(run, 0, range(0), commit=5), T0 + 3)
    assert store.ingest(run, _batch(run, 0, range(0), commit=6), T0 + 4).commits == 1
    done = store.ingest(run, _batch(run, 1, range(0, 3), commit=3), T0 + 5)
    assert [(f.step, f.status.value) for f in done.finalised] == [(0, "complete")]
    # 0-3 and 4-5 of rank 0 (seqs 2-3 were not stored twice), 0-2 of rank 1: three rows
    assert _rows(settings) == [(0, 3, 64, True), (0, 5, 32, True), (1, 2, 48, True)]
    step = store.get_step(store.get_run("r") or run, 0)
    assert step is not None and step.result is not None
    values = [_value(0, q) for q in range(6)] + [_value(1, q) for q in range(3)]
    exact = sum(map(Fraction, values), Fraction(0))
    metrics = step.result.metrics
    assert metrics["a"]["value"] == float(exact)
    assert (metrics["n"]["value"], metrics["m"]["value"]) == (9.0, float(exact / 9))


def test_a_step_left_complete_but_open_is_finalised_at_the_first_sweep(
    store: Store, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # PostgreSQL finalises a step after the commit of the batch that completed it; a
    # process stopped between the two leaves it open with every fragment counted
    sql = getattr(store, "sql", store)
    if not sql.dialect.finalises_after_commit:
        pytest.skip("SQLite finalises in the batch's own transaction")
    run, _ = store.register_run("r", lambda _: RunDraft(2, SPEC, 60.0), T0)
    monkeypatch.setattr(type(sql), "_finalise_after", lambda *_: None)  # stops in between
    store.ingest(run, _batch(run, 0, range(0, 2), commit=2), T0 + 1)
    done = store.ingest(run, _batch(run, 1, range(0, 1), commit=1), T0 + 2)
    assert done.finalised == []
    monkeypatch.undo()
    step = store.get_step(run, 0)
    assert step is not None and step.status.value == "open"
    restarted = open_store(settings)  # its first sweep, long before the step's deadline
    try:
        swept = restarted.sweep(T0 + 3)
        assert [(f.step, f.status.value, f.revision) for f in swept] == [(0, "complete", 1)]
        assert restarted.sweep(T0 + 4) == []  # once
    finally:
        restarted.close()
    step = store.get_step(run, 0)
    assert step is not None and step.result is not None
    exact = sum(map(Fraction, [_value(0, 0), _value(0, 1), _value(1, 0)]), Fraction(0))
    assert step.result.metrics["a"]["value"] == float(exact)


def test_the_first_sweep_leaves_a_step_first_seen_since_the_store_opened_to_its_batch(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a first sweep that comes late (the database unreachable until then) can land
    # between a batch's commit and its finalisation: the step is the batch's to finalise
    opened = open_store(settings, opened_at=T0)
    try:
        sql = getattr(opened, "sql", opened)
        if not sql.dialect.finalises_after_commit:
            pytest.skip("SQLite finalises in the batch's own transaction")
        run, _ = opened.register_run("r", lambda _: RunDraft(2, SPEC, 60.0), T0)
        monkeypatch.setattr(type(sql), "_finalise_after", lambda *_: None)  # in between
        opened.ingest(run, _batch(run, 0, range(0, 2), commit=2), T0 + 1)
        assert opened.ingest(run, _batch(run, 1, range(0, 1), commit=1), T0 + 2).finalised == []
        monkeypatch.undo()
        assert opened.sweep(T0 + 3) == []  # not stranded: first seen at T0 + 1
        step = opened.get_step(run, 0)
        assert step is not None and step.status.value == "open"
        swept = opened.sweep(T0 + 1 + 60.0)  # its deadline still finalises it
        assert [(f.step, f.status.value) for f in swept] == [(0, "complete")]
    finally:
        opened.close()
