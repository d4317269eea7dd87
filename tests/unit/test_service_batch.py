"""Checking a decoded batch against its run (pure, no database)."""

from __future__ import annotations

import base64
import math
import struct

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


def _compact(steps: list[int], values: list[list[float]], metrics: tuple[str, ...] = ("a", "n")):  # type: ignore[no-untyped-def]
    """A compact batch of one row per step (rank 0, seq 0), in ``metrics`` order."""
    raw = b"".join(struct.pack(f"<{len(row)}d", *row) for row in values)
    body = {
        "columnar": {
            "metrics": list(metrics),
            "step": steps,
            "rank": [0] * len(steps),
            "seq": [0] * len(steps),
            "values": base64.b64encode(raw).decode(),
        }
    }
    return decode_batch(body)


@pytest.mark.parametrize("count", [-1.0, 0.5, math.nan, math.inf, -math.inf, 2.0**63])
def test_a_compact_count_that_is_not_a_count_names_its_cell(count: float) -> None:
    batch = _compact([0, 1, 2], [[1.0, 2.0], [1.0, 3.0], [1.0, count]])
    with pytest.raises(InvalidValue) as info:
        prepare(RUN, batch, columnar=True)
    assert info.value.where == "columnar.values[5]"


def test_a_compact_count_may_be_the_largest_below_2_63() -> None:
    batch = _compact([0], [[1.0, float(2**63 - 1024)]])
    assert len(prepare(RUN, batch, columnar=True).fragments) == 1


def test_a_compact_batch_packs_each_row_under_its_key() -> None:
    batch = _compact([4, 2, 9], [[0.25, 1.0], [0.5, 2.0], [-0.0, 3.0]])
    out = prepare(RUN, batch, columnar=True)
    assert list(out.fragments) == [(4, 0, 0), (2, 0, 0), (9, 0, 0)]
    assert out.origin == {(4, 0, 0): 0, (2, 0, 0): 1, (9, 0, 0): 2}
    assert out.fragments[(9, 0, 0)] == (struct.pack("<2d", -0.0, 3.0), None, None)
    shuffled = prepare(RUN, _compact([4], [[1.0, 0.25]], ("n", "a")), columnar=True)
    assert shuffled.fragments[(4, 0, 0)][0] == struct.pack("<2d", 0.25, 1.0)


def test_a_compact_fragment_twice_is_kept_once_or_refused_when_it_differs() -> None:
    same = prepare(RUN, _compact([3, 3], [[1.0, 2.0], [1.0, 2.0]]), columnar=True)
    assert list(same.fragments) == [(3, 0, 0)]
    with pytest.raises(FragmentConflict) as info:
        prepare(RUN, _compact([3, 3], [[1.0, 2.0], [1.5, 2.0]]), columnar=True)
    assert info.value.where == "columnar.step[1]"
