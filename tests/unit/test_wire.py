"""The wire format: both forms decode to the same batch; bad input names the item."""

from __future__ import annotations

import base64
import math
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from steptally.client.wire import (
    FragmentBatch,
    WireError,
    decode_batch,
    encode_columnar,
    encode_number,
    encode_rows,
)

ROWS = {
    "fragments": [
        {"step": 1, "rank": 0, "seq": 0, "values": {"a": 1, "b": "NaN"}},
        {"step": 1, "rank": 1, "seq": 0, "values": {"a": "-Infinity"}},
    ],
    "commits": [{"step": 1, "rank": 0, "fragments": 1}],
}


def test_row_form_decodes_with_absent_cells_and_non_finite_strings() -> None:
    batch = decode_batch(ROWS)
    rows = list(batch.rows())
    assert rows[0][:3] == (1, 0, 0) and rows[0][3]["a"] == 1.0 and math.isnan(rows[0][3]["b"])
    assert rows[1] == (1, 1, 0, {"a": -math.inf})
    assert batch.commits[0].fragments == 1


def test_compact_and_row_forms_round_trip() -> None:
    batch = decode_batch(ROWS)
    again = decode_batch(encode_columnar(batch))
    assert again.values.tobytes() == batch.values.tobytes()
    assert again.present == batch.present
    assert encode_rows(again) == encode_rows(batch)
    assert encode_rows(again)["fragments"][0]["values"]["b"] == "NaN"


@given(st.lists(st.floats(), min_size=1, max_size=20))
def test_compact_form_keeps_every_bit_and_canonicalises_nan(values: list[float]) -> None:
    raw = b"".join(struct.pack("<d", v) for v in values)
    body = {
        "columnar": {
            "metrics": ["x"],
            "step": [0] * len(values),
            "rank": [0] * len(values),
            "seq": list(range(len(values))),
            "values": base64.b64encode(raw).decode(),
        }
    }
    batch = decode_batch(body)
    for got, sent in zip(batch.values, values, strict=True):
        if math.isnan(sent):
            assert struct.pack("<d", got) == struct.pack("<d", math.nan)
        else:
            assert struct.pack("<d", got) == struct.pack("<d", sent)


def test_a_nan_payload_does_not_change_identity() -> None:
    odd_nan = struct.pack("<Q", 0x7FF8_0000_0000_0123)
    body = {
        "columnar": {
            "metrics": ["x"],
            "step": [0],
            "rank": [0],
            "seq": [0],
            "values": base64.b64encode(odd_nan).decode(),
        }
    }
    assert decode_batch(body).values.tobytes() == struct.pack("<d", math.nan)


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({"fragments": [{"step": -1, "rank": 0, "seq": 0, "values": {}}]}, "fragments[0].step"),
        ({"fragments": [{"step": 0, "rank": True, "seq": 0, "values": {}}]}, "fragments[0].rank"),
        ({"fragments": [{"step": 0, "rank": 0, "values": {}}]}, "fragments[0]"),
        (
            {"fragments": [{"step": 0, "rank": 0, "seq": 0, "values": {"a": "1"}}]},
            "fragments[0].values.a",
        ),
        (
            {"fragments": [{"step": 0, "rank": 0, "seq": 0, "values": {"a b": 1}}]},
            "fragments[0].values",
        ),
        ({"commits": [{"step": 0, "rank": 0}]}, "commits[0]"),
        (
            {"columnar": {"metrics": ["a"], "step": [0], "rank": [0], "seq": [0], "values": "!!"}},
            "columnar.values",
        ),
        (
            {"columnar": {"metrics": ["a"], "step": [0], "rank": [0, 1], "seq": [0], "values": ""}},
            "columnar.rank",
        ),
        (
            {"columnar": {"metrics": ["a"], "step": [0], "rank": [0], "seq": [0], "values": ""}},
            "columnar.values",
        ),
        ({"surprise": 1}, ""),
    ],
)
def test_bad_bodies_name_the_item(body: object, where: str) -> None:
    with pytest.raises(WireError) as info:
        decode_batch(body)
    assert info.value.where == where


def test_encode_number() -> None:
    assert [encode_number(v) for v in (1.5, math.nan, math.inf, -math.inf)] == [
        1.5,
        "NaN",
        "Infinity",
        "-Infinity",
    ]


def test_empty_batch() -> None:
    assert len(decode_batch({})) == 0
    assert isinstance(decode_batch({"fragments": []}), FragmentBatch)


def test_exact_sums_round_trip_in_both_forms() -> None:
    tiny = 2.0**-80
    rows = {
        "fragments": [
            {"step": 0, "rank": 0, "seq": 0, "values": {"a": [1.0, tiny], "n": 2}},
            {"step": 0, "rank": 0, "seq": 1, "values": {"a": [3.0], "b": [5.0, -tiny, tiny**2]}},
        ]
    }
    batch = decode_batch(rows)
    assert list(batch.values) == [1.0, 2.0, 0.0, 3.0, 0.0, 5.0]
    assert batch.tails == {0: (tiny,), 5: (-tiny, tiny**2)}
    assert batch.row(0) == {"a": (1.0, tiny), "n": 2.0}
    assert batch.row(1) == {"a": 3.0, "b": (5.0, -tiny, tiny**2)}  # a 1-term list is a number
    compact = encode_columnar(batch)
    assert compact["columnar"]["tails"]["cells"] == [0, 5]
    assert compact["columnar"]["tails"]["lengths"] == [1, 2]
    again = decode_batch(compact)
    assert list(again.rows()) == list(batch.rows())
    assert decode_batch(encode_rows(again)).tails == batch.tails
    assert "tails" not in encode_columnar(decode_batch(ROWS))["columnar"]  # none: no block


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ([], "fragments[0].values.a"),
        ([1.0] * 65, "fragments[0].values.a"),
        ([1.0, "NaN"], "fragments[0].values.a"),
        (["Infinity", 1.0], "fragments[0].values.a"),
        ([1.0, "x"], "fragments[0].values.a[1]"),
    ],
)
def test_bad_exact_sums_name_the_value(value: object, where: str) -> None:
    body = {"fragments": [{"step": 0, "rank": 0, "seq": 0, "values": {"a": value}}]}
    with pytest.raises(WireError) as info:
        decode_batch(body)
    assert info.value.where == where


@pytest.mark.parametrize("key", ["fragments", "commits"])
def test_an_empty_object_is_not_an_empty_list(key: str) -> None:
    assert decode_batch({key: None}).commits == []  # null: left out
    with pytest.raises(WireError, match="must be a list"):
        decode_batch({key: {}})


def _columnar(**fields: object) -> dict[str, object]:
    base: dict[str, object] = {
        "metrics": ["a"],
        "step": [0, 1, 2],
        "rank": [0, 0, 0],
        "seq": [0, 0, 0],
        "values": base64.b64encode(struct.pack("<3d", 1.0, 2.0, 3.0)).decode(),
    }
    return {"columnar": {**base, **fields}}


@pytest.mark.parametrize("bad", [-1, True, 2**63, 1.0, "1", None])
@pytest.mark.parametrize("column", ["step", "rank", "seq"])
def test_a_bad_compact_integer_names_its_entry(column: str, bad: object) -> None:
    with pytest.raises(WireError) as info:
        decode_batch(_columnar(**{column: [0, 1, bad]}))
    assert info.value.where == f"columnar.{column}[2]"


def test_the_largest_compact_integer_is_taken() -> None:
    assert decode_batch(_columnar(step=[0, 2**63 - 1, 5])).steps == [0, 2**63 - 1, 5]


@pytest.mark.parametrize(
    ("metrics", "says"),
    [
        (["a", 1], "must be a list of metric names"),
        (["a", {"b": 1}], "must be a list of metric names"),
        (["a", "b c"], "is not a valid metric name"),
        (["a", "b", "a"], "names a metric twice"),
    ],
)
def test_bad_metric_names_are_refused_even_after_a_good_list(
    metrics: list[object], says: str
) -> None:
    raw = base64.b64encode(bytes(8 * 3 * len(metrics))).decode()
    good = ["a", "b", "c"][: len(metrics)]
    assert decode_batch(_columnar(metrics=good, values=raw)).metrics == good  # remembered
    assert decode_batch(_columnar(metrics=good, values=raw)).metrics == good
    with pytest.raises(WireError, match=says) as info:
        decode_batch(_columnar(metrics=metrics, values=raw))
    assert info.value.where == "columnar.metrics"


@given(st.lists(st.sampled_from([math.inf, -math.inf, 1.0, -2.5, 1e308, math.nan]), max_size=12))
def test_only_nan_is_canonicalised_among_infinities_and_overflowing_sums(
    values: list[float],
) -> None:
    odd_nan = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_0000_0123))[0]
    sent = [odd_nan if math.isnan(v) else v for v in values]
    raw = b"".join(struct.pack("<d", v) for v in sent)
    body = _columnar(
        step=[0] * len(sent),
        rank=[0] * len(sent),
        seq=list(range(len(sent))),
        values=base64.b64encode(raw).decode(),
    )
    got = decode_batch(body).values.tobytes()
    want = b"".join(struct.pack("<d", math.nan if math.isnan(v) else v) for v in sent)
    assert got == want
