"""Checking a decoded batch against its run (pure, no database)."""

from __future__ import annotations

import pytest

from steptally.client.algebra import MetricSpec
from steptally.client.wire import decode_batch
from steptally.service.domain.batch import prepare
from steptally.service.domain.run import RunRecord
from steptally.service.errors import (
    CommitConflict,
    FragmentConflict,
    InvalidValue,
    RankOutOfRange,
    UnknownMetric,
)

RUN = RunRecord(
    1, "r", 2, MetricSpec.build({"a": "sum", "n": "count"}, {"m": "a / n"}), 60.0, 0.0, ("a", "n")
)


def _rows(*frags: tuple[int, int, int, dict[str, object]], commits: object = ()) -> object:
    return decode_batch(
        {
            "fragments": [{"step": s, "rank": r, "seq": q, "values": v} for s, r, q, v in frags],
            "commits": [{"step": s, "rank": r, "fragments": n} for s, r, n in commits],  # type: ignore[attr-defined]
        }
    )


def test_prepare_packs_in_run_column_order_whatever_the_batch_order() -> None:
    a = prepare(RUN, _rows((0, 0, 0, {"n": 2, "a": 1.5})), columnar=False)  # type: ignore[arg-type]
    b = prepare(RUN, _rows((0, 0, 0, {"a": 1.5, "n": 2})), columnar=False)  # type: ignore[arg-type]
    assert a.fragments == b.fragments
    assert a.steps() == [0]


@pytest.mark.parametrize(
    ("batch", "error", "where"),
    [
        (_rows((0, 2, 0, {"a": 1.0})), RankOutOfRange, "fragments[0].rank"),
        (_rows((0, 0, 0, {"zz": 1.0})), UnknownMetric, "fragments[0].values.zz"),
        (_rows((0, 0, 0, {"m": 1.0})), UnknownMetric, "fragments[0].values.m"),
        (_rows((0, 0, 0, {"n": -1})), InvalidValue, "fragments[0].values.n"),
        (_rows((0, 0, 0, {"n": 0.5})), InvalidValue, "fragments[0].values.n"),
        (_rows((0, 0, 0, {"a": 1}), (0, 0, 0, {"a": 2})), FragmentConflict, "fragments[1]"),
        (_rows(commits=[(0, 0, 1), (0, 0, 2)]), CommitConflict, "commits[1]"),
        (_rows(commits=[(0, 3, 1)]), RankOutOfRange, "commits[0].rank"),
    ],
)
def test_prepare_rejects(batch: object, error: type[Exception], where: str) -> None:
    with pytest.raises(error) as info:
        prepare(RUN, batch, columnar=False)  # type: ignore[arg-type]
    assert info.value.where == where  # type: ignore[attr-defined]


def test_same_fragment_twice_in_a_batch_is_kept_once() -> None:
    batch = prepare(RUN, _rows((0, 0, 0, {"a": 1}), (0, 0, 0, {"a": 1.0})), columnar=False)  # type: ignore[arg-type]
    assert len(batch.fragments) == 1
