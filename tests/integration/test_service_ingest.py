"""Ingest: exactness end to end, idempotency, all-or-nothing, validation, size limits."""

from __future__ import annotations

import base64
import gzip
import math
import struct
from fractions import Fraction
from typing import Any

from steptally.client.wire import Commit, FragmentBatch, encode_columnar

Api = Any  # the `api` fixture of conftest.py


def _error(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == code
    return error


def _nothing_stored(api: Api) -> None:
    assert api.client.get("/v1/runs/r/steps/0").status_code == 404


def test_sums_are_exact_across_ranks(api: Api) -> None:
    api.register(world_size=3, derived={"mean": "a / n"})
    values = [1e17, 1.0, -1e17]
    frags = [(0, r, 0, {"a": v, "n": 1}) for r, v in enumerate(values)]
    body = api.send(frags, [(0, r, 1) for r in range(3)]).json()
    assert body["finalised"] == [{"step": 0, "status": "complete", "revision": 1}]
    step = api.step(0)
    assert step["metrics"]["a"]["value"] == 1.0  # a float sum in order would give 0.0
    assert step["metrics"]["mean"]["value"] == 1.0 / 3.0


def test_derived_quotient_is_rounded_once(api: Api) -> None:
    api.register(world_size=2, derived={"q": "a / b"}, metrics={"a": "sum", "b": "sum"})
    a = [0.1, 0.2, 0.3, 1e-9]
    b = [0.7, 0.11, 3e5, 1e-3]
    frags = [(0, i % 2, i // 2, {"a": a[i], "b": b[i]}) for i in range(4)]
    api.send(frags, [(0, 0, 2), (0, 1, 2)])
    exact = Fraction(sum(map(Fraction, a))) / Fraction(sum(map(Fraction, b)))
    got = api.value(0, "q")
    assert struct.pack("<d", got) == struct.pack("<d", float(exact))


def test_non_finite_values_round_trip_as_strings(api: Api) -> None:
    api.register(world_size=1, metrics={"s": "sum", "hi": "max", "lo": "min"})
    api.send([(0, 0, 0, {"s": "NaN", "hi": "Infinity", "lo": "-Infinity"})], [(0, 0, 1)])
    metrics = api.step(0)["metrics"]
    assert metrics["s"]["value"] == "NaN"
    assert metrics["s"]["non_finite"] == 1
    assert metrics["hi"]["value"] == "Infinity"
    assert metrics["lo"]["value"] == "-Infinity"


def test_duplicate_is_acknowledged_and_counted_once(api: Api) -> None:
    api.register()
    frags = [(0, 0, 0, {"a": 2.5, "n": 3}), (0, 1, 0, {"a": 1.0, "n": 1})]
    assert api.send(frags).json()["accepted"] == 2
    again = api.send(frags, [(0, 0, 1), (0, 1, 1)]).json()
    assert (again["accepted"], again["duplicates"], again["commits"]) == (0, 2, 2)
    assert api.value(0, "a") == 3.5
    assert api.value(0, "n") == 4.0
    retry = api.send(frags, [(0, 0, 1), (0, 1, 1)])  # a retried batch of a complete step
    assert retry.status_code == 200
    assert retry.json()["duplicates"] == 2


def test_conflicting_fragment_is_409_and_changes_nothing(api: Api) -> None:
    api.register()
    api.send([(0, 0, 0, {"a": 2.5, "n": 3})])
    before = api.step(0)
    response = api.send([(0, 1, 0, {"a": 9.0, "n": 1}), (0, 0, 0, {"a": 2.0, "n": 3})])
    error = _error(response, 409, "fragment_conflict")
    assert error["where"] == "fragments[1]"
    assert api.step(0) == before


def test_batch_is_all_or_nothing(api: Api) -> None:
    api.register()
    good = (0, 0, 0, {"a": 1.0, "n": 1})
    _error(api.send([good, (0, 5, 0, {"a": 1.0})]), 422, "rank_out_of_range")
    _error(api.send([good, (1, 0, 0, {"a": 1.0, "n": 0.5})]), 422, "invalid_value")
    _error(api.send([good], [(0, 0, 1), (0, 0, 2)]), 409, "commit_conflict")
    _nothing_stored(api)
    api.send([(0, 1, 0, {"a": 1.0, "n": 1})], [(0, 1, 1)])
    _error(api.send([good, (0, 1, 1, {"a": 1.0})], [(0, 0, 1)]), 409, "commit_conflict")
    assert api.step(0)["fragments"]["received"] == 1
    assert api.step(0)["ranks_committed"] == [1]


def test_duplicate_keys_inside_one_batch(api: Api) -> None:
    api.register()
    same = api.send([(0, 0, 0, {"a": 1.0}), (0, 0, 0, {"a": 1.0})])
    assert same.json()["accepted"] == 1
    differ = api.send([(1, 0, 0, {"a": 1.0}), (1, 0, 0, {"a": 2.0})])
    _error(differ, 409, "fragment_conflict")
    assert api.client.get("/v1/runs/r/steps/1").status_code == 404


def test_commit_conflicts(api: Api) -> None:
    api.register()
    api.send([(0, 0, 0, {"a": 1.0}), (0, 0, 1, {"a": 1.0})], [(0, 0, 2)])
    _error(api.send([], [(0, 0, 3)]), 409, "commit_conflict")
    _error(api.send([(0, 0, 2, {"a": 1.0})]), 409, "commit_conflict")
    _error(api.send([(0, 1, 4, {"a": 1.0})], [(0, 1, 2)]), 409, "commit_conflict")
    api.send([(0, 1, 4, {"a": 1.0})])
    _error(api.send([], [(0, 1, 4)]), 409, "commit_conflict")
    assert api.step(0)["ranks_committed"] == [0]


def test_fragment_for_complete_step_is_409(api: Api) -> None:
    api.register(world_size=1)
    api.send([(0, 0, 0, {"a": 1.0})], [(0, 0, 1)])
    error = _error(api.send([(0, 0, 1, {"a": 1.0})]), 409, "step_complete")
    assert "complete" in error["message"]
    assert api.value(0, "a") == 1.0


def test_rank_out_of_range_unknown_metric_invalid_count(api: Api) -> None:
    api.register(derived={"m": "a / n"})
    error = _error(api.send([(0, 2, 0, {"a": 1.0})]), 422, "rank_out_of_range")
    assert error["where"] == "fragments[0].rank"
    assert "world size 2" in error["message"]
    _error(api.send([], [(0, 7, 1)]), 422, "rank_out_of_range")
    error = _error(api.send([(0, 0, 0, {"a": 1.0}), (0, 0, 1, {"zz": 1.0})]), 422, "unknown_metric")
    assert error["where"] == "fragments[1].values.zz"
    assert "'zz'" in error["message"]
    _error(api.send([(0, 0, 0, {"m": 1.0})]), 422, "unknown_metric")
    for bad in (-1, 1.5, "NaN", "Infinity"):
        _error(api.send([(0, 0, 0, {"n": bad})]), 422, "invalid_value")
    _nothing_stored(api)


def test_invalid_payloads(api: Api) -> None:
    api.register()
    post = api.client.post
    bad = post("/v1/runs/r/fragments", content=b"{", headers={"content-type": "application/json"})
    _error(bad, 400, "bad_json")
    _error(post("/v1/runs/r/fragments", json={"fragments": [{"step": 0}]}), 422, "invalid_payload")
    _error(post("/v1/runs/r/fragments", json=[1]), 422, "invalid_payload")
    _error(api.send([(0, 0, 0, {"a": "1.0"})]), 422, "invalid_payload")


def test_compact_form_and_gzip(api: Api) -> None:
    api.register(metrics={"a": "sum", "n": "count"})
    batch = FragmentBatch(metrics=["n", "a"], steps=[0, 0], ranks=[0, 1], seqs=[0, 0])
    batch.values.extend([3.0, 1e17, 1.0, -1e17])
    batch.commits = [Commit(0, 0, 1), Commit(0, 1, 1)]
    import orjson

    body = gzip.compress(orjson.dumps(encode_columnar(batch)))
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    response = api.client.post("/v1/runs/r/fragments", content=body, headers=headers)
    assert response.json()["finalised"][0]["status"] == "complete"
    assert api.value(0, "a") == 0.0
    assert api.value(0, "n") == 4.0
    rows = {"fragments": [{"step": 0, "rank": 0, "seq": 0, "values": {"a": 1e17, "n": 3}}]}
    assert api.client.post("/v1/runs/r/fragments", json=rows).json()["duplicates"] == 1


def test_compact_form_with_absent_cells(api: Api) -> None:
    api.register(world_size=1, metrics={"a": "sum", "n": "count", "m": "max"})
    values = struct.pack("<4d", 2.0, 7.0, 0.0, -3.0)
    present = base64.b64encode(bytes([1, 1, 0, 1])).decode()
    body = {
        "columnar": {
            "metrics": ["a", "m"],
            "step": [0, 0],
            "rank": [0, 0],
            "seq": [0, 1],
            "values": base64.b64encode(values).decode(),
            "present": present,
        },
        "commits": [{"step": 0, "rank": 0, "fragments": 2}],
    }
    assert api.client.post("/v1/runs/r/fragments", json=body).status_code == 200
    metrics = api.step(0)["metrics"]
    assert (metrics["a"]["value"], metrics["a"]["values"]) == (2.0, 1)
    assert (metrics["m"]["value"], metrics["m"]["values"]) == (7.0, 2)
    assert metrics["n"]["value"] == 0.0


def test_too_large_body_and_gzip_bomb(make_client: Any) -> None:
    _, client = make_client(max_body_bytes=2048)
    client.post("/v1/runs", json={"name": "r", "world_size": 1, "metrics": {"a": "sum"}})
    big = {
        "fragments": [{"step": 0, "rank": 0, "seq": i, "values": {"a": 1.0}} for i in range(100)]
    }
    _error(client.post("/v1/runs/r/fragments", json=big), 413, "too_large")
    bomb = gzip.compress(b'{"fragments": [' + b" " * 1_500_000 + b"]}")
    assert len(bomb) < 2048
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    error = _error(
        client.post("/v1/runs/r/fragments", content=bomb, headers=headers), 413, "too_large"
    )
    assert "decompressed" in error["message"]
    brotli = {"content-type": "application/json", "content-encoding": "br"}
    _error(
        client.post("/v1/runs/r/fragments", content=b"{}", headers=brotli),
        400,
        "unsupported_encoding",
    )
    assert client.get("/v1/runs/r/steps/0").status_code == 404


def test_nan_payload_is_canonical_for_duplicates(api: Api) -> None:
    api.register(world_size=1, metrics={"a": "sum"})

    def columnar(nan_bits: int) -> dict[str, Any]:
        raw = struct.pack("<Q", nan_bits)
        assert math.isnan(struct.unpack("<d", raw)[0])
        return {
            "columnar": {
                "metrics": ["a"],
                "step": [0],
                "rank": [0],
                "seq": [0],
                "values": base64.b64encode(raw).decode(),
                "present": None,
            }
        }

    first = api.client.post("/v1/runs/r/fragments", json=columnar(0x7FF8000000000001))
    second = api.client.post("/v1/runs/r/fragments", json=columnar(0xFFF8000000000000))
    assert (first.json()["accepted"], second.json()["duplicates"]) == (1, 1)
