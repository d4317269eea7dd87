"""The reporter's compact body on its fast path: the same prepared batch as the general
path (decode, check, pack, partial states), or no answer at all — never an answer the
general path would not give."""

from __future__ import annotations

import base64
import math
import random
import struct
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steptally.client.algebra import MetricSpec
from steptally.client.wire import Commit, FragmentBatch, WireError, decode_batch, encode_columnar
from steptally.service.domain import compact, partial
from steptally.service.domain.batch import PreparedBatch, plain_of, prepare
from steptally.service.domain.run import RunRecord
from steptally.service.errors import ServiceError
from steptally.service.store.group_commit import batch_bytes

KINDS = {"a": "sum", "b": "sum", "n": "count", "g": "count", "lo": "min", "hi": "max"}
SPEC = MetricSpec.from_json({"metrics": KINDS, "guards": {"hi": "g"}})
WORLD = 4
RUN = RunRecord(1, "r", WORLD, SPEC, 60.0, 0.0, tuple(KINDS))
WIDTH = len(KINDS)

pytestmark = pytest.mark.skipif(partial.kernel is None, reason="the kernel is not built")

# NaNs with payloads and signs, as a body's bytes may carry them
NANS = [0x7FF8000000000000, 0x7FF0000000000001, 0xFFF8000000000000, 0x7FFFFFFFFFFFFFFF]
SPECIAL = [0.0, -0.0, math.inf, -math.inf, 5e-324, 1.5, -2.5, 1e308, -1e-300]
BAD_COUNTS = [2.0**63, -1.0, 0.5, math.inf, math.nan]
BAD_INDEX = [-1, 2**63, True, 1.0, None]


def _bits(x: float) -> int:
    bits: int = struct.unpack("<Q", struct.pack("<d", x))[0]
    return bits


def _general(data: Any) -> PreparedBatch | str:
    """What the general path makes of ``data``: the prepared batch, or the error."""
    try:
        out = prepare(RUN, decode_batch(data), columnar=True)
    except (WireError, ServiceError) as exc:
        return type(exc).__name__
    out.states = partial.states_of(RUN, out.fragments)
    out.set_plain(plain_of(out.fragments, out.commits))
    return out


def _same(fast: PreparedBatch, general: PreparedBatch) -> None:
    assert fast.fragments == general.fragments
    assert list(fast.fragments) == list(general.fragments)
    assert fast.origin == general.origin
    assert fast.commits == general.commits
    assert fast.commit_origin == general.commit_origin
    assert fast.states == general.states
    assert list(fast.states) == list(general.states)
    assert fast.plain == general.plain
    assert list(fast.plain) == list(general.plain)
    assert fast.columnar and general.columnar
    assert fast.rejected == general.rejected == []
    # a plain batch's size is its pairs' (one a pair), the same as its fragments'
    cells = fast.fragments.values()
    size = sum(len(v) + len(p or b"") + len(t or b"") for v, p, t in cells)
    assert batch_bytes(fast) == batch_bytes(general) == size + 16 * len(fast.commits)


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    """Compact bodies of the reporter's shape, each part now and then off it or wrong
    (about half of them right, a third of the shape)."""
    rng = random.Random(draw(st.integers(0, 2**64)))  # uniform choices, seeded

    def rarely(p: float = 0.03) -> bool:
        return rng.random() < p

    def index() -> Any:
        if rarely(0.01):
            return rng.choice(BAD_INDEX)
        return WORLD + rng.randrange(3) if rarely(0.02) else rng.randrange(WORLD)

    def value() -> int:
        if rarely(0.05):
            return rng.choice(NANS)
        return _bits(rng.choice(SPECIAL) if rarely(0.2) else rng.uniform(-1e3, 1e3))

    def count() -> int:
        if rarely(0.01):
            return _bits(rng.choice(BAD_COUNTS))
        return _bits(rng.choice([-0.0, 2.0**63 - 1024]) if rarely(0.05) else rng.randrange(9))

    n = rng.randrange(6) if rarely(0.2) else 8
    pair = (rng.randrange(4), rng.randrange(WORLD))
    keys = [
        (pair[0], pair[1], i) if not rarely(0.1) else (index(), index(), index()) for i in range(n)
    ]
    cells = [b for _ in range(n) for b in (value(), value(), count(), count(), value(), value())]
    raw = struct.pack(f"<{len(cells)}Q", *cells)
    if rarely():
        raw = raw[:-8]
    metrics: Any = list(KINDS)
    if rarely():
        metrics = rng.choice([metrics[::-1], metrics[:-1], [*metrics[:-1], "zz"]])
    columnar: dict[str, Any] = {
        "metrics": metrics,
        "step": [k[0] for k in keys],
        "rank": [k[1] for k in keys],
        "seq": [k[2] for k in keys],
        "values": base64.b64encode(raw).decode(),
        "present": None,
    }
    if rarely():
        columnar["present"] = base64.b64encode(b"\x01" * len(cells)).decode()
    if rarely(0.05):  # base64 that a strict decoder refuses, or only just takes
        text = columnar["values"]
        at = rng.randrange(len(text) + 1)
        columnar["values"] = rng.choice(
            [
                text[:-1] + "!",
                text[:at] + text[at + 1 :],
                text + "=",
                text[:at] + rng.choice(["\n", " ", "=", "é", "-", "_"]) + text[at:],
                text.rstrip("=") or "=",
                text + "AAAA",
                text[:-4] + "AA==" if len(text) > 4 else text,
            ]
        )
    if rarely():
        columnar["seq"] = columnar["seq"][:-1]
    if rarely():
        columnar["tails"] = {"cells": [0], "lengths": [1], "values": "AAAAAAAAAAA="}
    commits: Any = [
        {"step": index(), "rank": index(), "fragments": rng.randrange(9)}
        if rarely(0.2)
        else {"step": pair[0], "rank": pair[1], "fragments": n}
        for _ in range(rng.choice([0, 1, 1, 1, 2]))
    ]
    if rarely():
        commits = [{**c, "extra": 1} for c in commits] or {"step": 0}
    body: dict[str, Any] = {"columnar": columnar, "commits": commits}
    if rarely(0.05):
        body.pop("commits")
    if rarely(0.05):
        body["commits"] = None
    if rarely():
        body[rng.choice(["fragments", "other"])] = []
    return orjson.loads(orjson.dumps(body))  # as the service parses it


def _plain(data: dict[str, Any]) -> bool:
    """The reporter's shape: the run's metrics in order, every cell, no tails, each
    fragment once, the values in canonical base64 (a strict decoder may also take an
    extra ``=``; the fast path leaves that to the general one)."""
    block = data["columnar"]
    keys = list(zip(block["step"], block["rank"], block["seq"], strict=True))
    text = block["values"]
    return (
        base64.b64encode(base64.b64decode(text)).decode() == text
        and data.keys() <= {"columnar", "commits"}
        and block["metrics"] == list(KINDS)
        and block["present"] is None
        and "tails" not in block
        and len(set(keys)) == len(keys) > 0
    )


@settings(max_examples=3000, deadline=None)
@given(bodies())
def test_the_fast_path_answers_as_the_general_path_or_not_at_all(data: dict[str, Any]) -> None:
    fast = compact.prepared(RUN, data)
    general = _general(data)
    if fast is not None:
        assert isinstance(general, PreparedBatch), general
        _same(fast, general)
    elif isinstance(general, PreparedBatch) and _plain(data):
        raise AssertionError("a right body of the reporter's shape missed the fast path")


def _reporters(rows: int, steps: list[int], ranks: list[int]) -> dict[str, Any]:
    batch = FragmentBatch(list(KINDS), steps, ranks, list(range(rows)))
    for i in range(rows):
        batch.values.extend([0.1 * i, -1e17, float(i), 1.0, -3.0 - i, 2.0**-1074 * i])
    batch.commits = [Commit(s, r, rows) for s, r in sorted(set(zip(steps, ranks, strict=True)))]
    return orjson.loads(orjson.dumps(encode_columnar(batch)))


@pytest.mark.parametrize(
    ("steps", "ranks"),
    [([3] * 8, [1] * 8), ([0, 0, 1, 1], [0, 2, 0, 2]), ([5], [3])],
)
def test_the_reporters_bodies_take_the_fast_path(steps: list[int], ranks: list[int]) -> None:
    data = _reporters(len(steps), steps, ranks)
    fast = compact.prepared(RUN, data)
    assert fast is not None
    general = _general(data)
    assert isinstance(general, PreparedBatch)
    _same(fast, general)
    assert len(fast.states) == len(set(zip(steps, ranks, strict=True)))
    # one pair with seqs from 0 is plain; pairs that share the seqs 0..n-1 are not
    assert fast.is_plain() is (len(set(zip(steps, ranks, strict=True))) == 1)


def test_nan_payloads_come_out_canonical_and_bad_counts_go_to_the_general_path() -> None:
    data = _reporters(2, [0, 0], [0, 0])
    raw = bytearray(base64.b64decode(data["columnar"]["values"]))
    raw[0:8] = struct.pack("<Q", 0xFFF0000000000001)  # a, row 0: a NaN with a payload
    data["columnar"]["values"] = base64.b64encode(raw).decode()
    fast = compact.prepared(RUN, data)
    assert fast is not None
    assert fast.fragments[(0, 0, 0)][0][:8] == struct.pack("<d", math.nan)
    raw[16:24] = struct.pack("<d", 1.5)  # n, row 0: not a count
    data["columnar"]["values"] = base64.b64encode(raw).decode()
    assert compact.prepared(RUN, data) is None
    assert _general(data) == "InvalidValue"


def test_an_extra_padding_sign_is_left_to_the_general_path() -> None:
    """Found by the generated bodies: a strict decoder takes an ``=`` after a whole
    quantum, pybase64 does not; the fast path gives no answer and the general path
    stores the body."""
    data = _reporters(3, [0, 0, 0], [1, 1, 1])  # 3 x 6 values: 144 bytes, no padding
    assert not data["columnar"]["values"].endswith("=")
    data["columnar"]["values"] += "="
    assert compact.prepared(RUN, data) is None
    assert isinstance(_general(data), PreparedBatch)


@pytest.mark.parametrize(
    ("seqs", "plain"),
    [
        ([2, 1, 0, 1, 0], 2),  # both pairs' seqs a permutation of 0..n-1: plain, in seq order
        ([0, 1, 1, 0, 2], 2),
        ([2, 0, 3, 1, 0], 1),  # (7, 1) holds 0, 2, 3 of 3: not plain, (7, 2) is
        ([0, 0, 0, 1, 1], 0),  # a key twice: the general path
    ],
)
def test_pairs_out_of_order_come_out_as_the_general_path_makes_them(
    seqs: list[int], plain: int
) -> None:
    """Two pairs, their rows interleaved and their seqs in any order: the compiled pack
    joins each plain pair's rows in seq order, as the general path does."""
    steps, ranks = [7, 7, 7, 7, 7], [1, 2, 1, 2, 1]
    batch = FragmentBatch(list(KINDS), steps, ranks, seqs)
    for i in range(5):
        batch.values.extend([0.5 * i, 1e17 + i, float(i), 2.0, -1.0 - i, 3.0 * i])
    batch.commits = [Commit(7, 1, 3), Commit(7, 2, 2)]
    data = orjson.loads(orjson.dumps(encode_columnar(batch)))
    fast = compact.prepared(RUN, data)
    general = _general(data)
    if len(set(zip(steps, ranks, seqs, strict=True))) < 5:
        assert (fast, general) == (None, "FragmentConflict")  # two values of one key
        return
    assert fast is not None and isinstance(general, PreparedBatch)
    _same(fast, general)
    assert len(fast.plain) == plain
