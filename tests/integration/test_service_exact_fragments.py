"""Exact sum fragments (float64 expansions) through the service, on both databases."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import orjson

from steptally.client.algebra.exact import expansion, scaled_int
from steptally.client.wire import Commit, FragmentBatch, encode_columnar

Api = Any  # the `api` fixture of conftest.py

# 1 + 2**-80 is no float64: its expansion is two terms, the first the rounded sum
TINY = 2.0**-80


def _error(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == code
    return error


def test_expansions_add_exactly_and_count_once(api: Api) -> None:
    api.register(world_size=2, derived={"mean": "a / n"})
    frags = [(0, 0, 0, {"a": [1.0, TINY], "n": 1}), (0, 1, 0, {"a": [-1.0], "n": 1})]
    api.send(frags, [(0, 0, 1), (0, 1, 1)])
    metrics = api.step(0)["metrics"]
    assert metrics["a"]["value"] == TINY  # the first terms alone would give 0.0
    assert metrics["a"]["values"] == 2  # one value per fragment, not per term
    assert metrics["mean"]["value"] == TINY / 2


def test_compact_form_tails_block(api: Api) -> None:
    api.register(world_size=2, metrics={"n": "count", "a": "sum"})
    batch = FragmentBatch(metrics=["n", "a"], steps=[0, 0], ranks=[0, 1], seqs=[0, 0])
    batch.values.extend([3.0, 1e17, 1.0, -1e17])
    batch.tails = {1: (3.0, TINY), 3: (-2.0,)}
    batch.commits = [Commit(0, 0, 1), Commit(0, 1, 1)]
    response = api.client.post("/v1/runs/r/fragments", content=orjson.dumps(encode_columnar(batch)))
    assert response.json()["finalised"][0]["status"] == "complete", response.text
    assert api.value(0, "a") == 1.0 + TINY
    assert api.value(0, "n") == 4.0


def test_any_split_of_the_same_values_gives_the_same_bits(api: Api) -> None:
    # each microbatch sends its exact sum: the step is the exact total, however split
    values = [0.1, 1e-20, 3.3, -0.1, 7e15, 1.0 / 3.0, -7e15, 2.0**-60]
    exact = sum(map(Fraction, values))
    for run, cuts in (("whole", [8]), ("pairs", [2, 2, 2, 2]), ("ones", [1] * 8)):
        api.register(name=run, world_size=1)
        frags, start = [], 0
        for seq, size in enumerate(cuts):
            terms = expansion(sum(scaled_int(v) for v in values[start : start + size]))
            frags.append((0, 0, seq, {"a": list(terms), "n": size}))
            start += size
        api.send(frags, [(0, 0, len(cuts))], run=run)
        assert api.value(0, "a", run=run) == float(exact)


def test_duplicate_compares_the_whole_expansion(api: Api) -> None:
    api.register()
    first = [(0, 0, 0, {"a": [1.0, TINY], "n": 1})]
    assert api.send(first).json()["accepted"] == 1
    assert api.send(first).json()["duplicates"] == 1
    before = api.step(0)
    other_tail = api.send([(0, 0, 0, {"a": [1.0, 2 * TINY], "n": 1})])
    assert _error(other_tail, 409, "fragment_conflict")["where"] == "fragments[0]"
    no_tail = api.send([(0, 0, 0, {"a": 1.0, "n": 1})])
    _error(no_tail, 409, "fragment_conflict")
    assert api.step(0) == before


def test_bad_expansions_are_422_and_change_nothing(api: Api) -> None:
    api.register(metrics={"a": "sum", "n": "count", "m": "max"})
    too_long = api.send([(0, 0, 0, {"a": [1.0] * 65})])
    assert "1 to 64" in _error(too_long, 422, "invalid_payload")["message"]
    empty = api.send([(0, 0, 0, {"a": []})])
    assert _error(empty, 422, "invalid_payload")["where"] == "fragments[0].values.a"
    non_finite = api.send([(0, 0, 0, {"a": [1.0, "Infinity"]})])
    _error(non_finite, 422, "invalid_payload")
    count = api.send([(0, 0, 0, {"n": [1, 2]})])
    assert _error(count, 422, "invalid_value")["where"] == "fragments[0].values.n"
    extreme = api.send([(0, 0, 0, {"m": [1.0, TINY]})])
    assert "is a max" in _error(extreme, 422, "invalid_value")["message"]
    assert api.client.get("/v1/runs/r/steps/0").status_code == 404


def test_bad_tails_block_is_422(api: Api) -> None:
    api.register(world_size=1)
    batch = FragmentBatch(metrics=["a"], steps=[0], ranks=[0], seqs=[0])
    batch.values.append(1.0)
    body = encode_columnar(batch)
    body["columnar"]["tails"] = {"cells": [1], "lengths": [1], "values": "AAAAAAAA8D8="}
    response = api.client.post("/v1/runs/r/fragments", json=body)
    assert _error(response, 422, "invalid_payload")["where"] == "columnar.tails.cells"
    body["columnar"]["tails"] = {"cells": [0], "lengths": [2], "values": "AAAAAAAA8D8="}
    response = api.client.post("/v1/runs/r/fragments", json=body)
    assert _error(response, 422, "invalid_payload")["where"] == "columnar.tails.values"
