"""Series: finalised steps only, stored values bit for bit, downsampling that keeps
every extreme, every partial or revised step and every odd value; on both databases."""

from __future__ import annotations

import math
import random
import struct
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi import FastAPI

Api = Any  # the `api` fixture of conftest.py


def _bits(value: Any) -> Any:
    return struct.pack("<d", value) if isinstance(value, float) else value


def _send_steps(api: Api, values: dict[int, dict[str, Any]], committed: set[int]) -> None:
    """One batch: each step's fragment from rank 0, committed where ``committed`` says."""
    fragments = [(s, 0, 0, v) for s, v in values.items()]
    response = api.send(fragments, [(s, 0, 1) for s in sorted(committed)])
    assert response.status_code == 200, response.text


def test_series_equals_the_stored_values_bit_for_bit(api: Api, db_url: str) -> None:
    api.register(world_size=1, metrics={"a": "sum", "n": "count"}, derived={"mean": "a / n"})
    rnd = random.Random(11)
    values: dict[int, dict[str, Any]] = {
        s: {"a": rnd.uniform(-1e6, 1e6) * 10 ** rnd.randint(-300, 300), "n": rnd.randint(1, 9)}
        for s in range(40)
    }
    values[3] = {"a": "NaN", "n": 2}
    values[4] = {"a": "Infinity", "n": 2}
    values[5] = {"a": -0.0, "n": 0}  # mean undefined: zero denominator
    values[6] = {"a": 0.1 + 0.2, "n": 3}
    _send_steps(api, values, set(values) - {39})  # step 39 stays open
    for metric in ("a", "n", "mean"):
        series = api.client.get(f"/v1/runs/r/series/{metric}").json()
        expected = [api.value(s, metric) for s in range(39)]
        assert series["steps"] == list(range(39))
        assert [_bits(v) for v in series["values"]] == [_bits(v) for v in expected]
        assert (series["total"], series["downsampled"]) == (39, False)
    mean = api.client.get("/v1/runs/r/series/mean", params={"start": 3, "end": 6}).json()
    assert mean["values"][:3] == ["NaN", "Infinity", None]
    assert _bits(mean["values"][3]) == _bits((0.1 + 0.2) / 3)
    engine = sa.create_engine(db_url)
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT m.name, v.value, v.state FROM step_values v JOIN metrics m "
            "ON m.run_id = v.run_id AND m.col = v.col WHERE v.step = 4 ORDER BY m.name"
        ).all()
        count = conn.exec_driver_sql("SELECT count(*) FROM step_values").scalar()
    engine.dispose()
    assert [tuple(r) for r in rows] == [("a", math.inf, 0), ("mean", math.inf, 0), ("n", 2.0, 0)]
    assert count == 39 * 3


def _expected_downsample(
    values: dict[int, float | str], buckets: int, always: set[int]
) -> list[int]:
    """Per bucket of steps, the earliest step of the least and of the greatest finite
    value; plus every non-finite value and the ``always`` steps."""
    lo, hi = min(values), max(values)
    kept = set(always)
    low: dict[int, tuple[float, int]] = {}
    high: dict[int, tuple[float, int]] = {}
    for step, v in sorted(values.items()):
        if isinstance(v, str) or math.isinf(v):
            kept.add(step)
            continue
        b = (step - lo) * buckets // (hi - lo + 1)
        if b not in low or v < low[b][0]:
            low[b] = (v, step)
        if b not in high or v > high[b][0]:
            high[b] = (v, step)
    return sorted(kept | {s for _, s in low.values()} | {s for _, s in high.values()})


def test_downsampling_keeps_extremes_and_every_odd_step(app: FastAPI, api: Api, clock: Any) -> None:
    api.register(world_size=1, metrics={"a": "sum"}, step_timeout_s=60.0)
    values: dict[int, float | str] = {s: float((s * 7919) % 23) for s in range(10, 410)}
    values[137] = 1e9  # a spike
    values[138] = -1e9
    values[200] = "NaN"
    values[201] = "-Infinity"
    partial, revised = {250, 251}, {300}
    _send_steps(api, {s: {"a": v} for s, v in values.items()}, set(values) - partial - revised)
    done = app.state.service.sweep(clock.now + 120)
    assert sorted(f.step for f in done) == [250, 251, 300]
    assert api.send([], [(300, 0, 1)]).json()["finalised"] == [
        {"step": 300, "status": "complete", "revision": 2}
    ]
    series = api.client.get("/v1/runs/r/series/a", params={"points": 40}).json()
    expected = _expected_downsample(values, 20, partial | revised)
    assert series["steps"] == expected
    assert (series["total"], series["downsampled"]) == (400, True)
    assert {137, 138, 200, 201, 250, 251, 300} <= set(series["steps"])
    at = dict(zip(series["steps"], series["values"], strict=True))
    assert (at[137], at[138], at[200], at[201]) == (1e9, -1e9, "NaN", "-Infinity")
    status = dict(zip(series["steps"], series["status"], strict=True))
    revision = dict(zip(series["steps"], series["revision"], strict=True))
    assert (status[250], revision[250]) == ("partial", 1)
    assert (status[300], revision[300]) == ("complete", 2)
    assert len(series["steps"]) == len(series["values"]) == len(series["status"])
    window = api.client.get(
        "/v1/runs/r/series/a", params={"points": 10, "start": 100, "end": 149}
    ).json()
    assert window["steps"] == _expected_downsample(
        {s: values[s] for s in range(100, 150)}, 5, set()
    )
    assert window["total"] == 50
    full = api.client.get("/v1/runs/r/series/a", params={"points": 400}).json()
    assert (full["downsampled"], full["steps"]) == (False, sorted(values))


def test_refinalised_step_replaces_its_values(app: FastAPI, api: Api, clock: Any) -> None:
    api.register(world_size=2, metrics={"a": "sum", "n": "count"}, derived={"mean": "a / n"})
    api.send([(0, 0, 0, {"a": 3.0, "n": 1})], [(0, 0, 1)])
    app.state.service.sweep(clock.now + 120)
    first = api.client.get("/v1/runs/r/series/mean").json()
    assert (first["values"], first["status"], first["revision"]) == ([3.0], ["partial"], [1])
    api.send([(0, 1, 0, {"a": 5.0, "n": 3})], [(0, 1, 1)])
    second = api.client.get("/v1/runs/r/series/mean").json()
    assert (second["values"], second["status"], second["revision"]) == ([2.0], ["complete"], [2])
    assert second["total"] == 1


@pytest.mark.parametrize(
    ("params", "where"),
    [
        ({"points": 1}, "query.points"),
        ({"points": 10_001}, "query.points"),
        ({"points": "many"}, "query.points"),
        ({"start": -1}, "query.start"),
        ({"start": 5, "end": 4}, "end"),
    ],
)
def test_bad_series_parameters(api: Api, params: dict[str, Any], where: str) -> None:
    api.register(world_size=1)
    api.send([(0, 0, 0, {"a": 1.0})], [(0, 0, 1)])
    response = api.client.get("/v1/runs/r/series/a", params=params)
    assert response.status_code == 422
    error = response.json()["error"]
    assert (error["code"], error["where"]) == ("invalid_payload", where)
    assert api.client.get("/v1/runs/r/series/a").json()["steps"] == [0]


def test_series_of_unknown_things(api: Api) -> None:
    api.register(world_size=1)
    unknown_metric = api.client.get("/v1/runs/r/series/zz")
    assert (unknown_metric.status_code, unknown_metric.json()["error"]["code"]) == (
        404,  # a series that is not there
        "metric_not_found",
    )
    assert api.client.get("/v1/runs/zz/series/a").status_code == 404
    empty = api.client.get("/v1/runs/r/series/a", params={"points": 10}).json()
    assert (empty["steps"], empty["total"], empty["downsampled"]) == ([], 0, False)


def test_migration_fills_values_of_steps_finalised_before_it(tmp_path: Any) -> None:
    from alembic import command

    from steptally.service.store.migration import alembic_config

    url = f"sqlite:///{tmp_path / 'old.sqlite3'}"
    command.upgrade(alembic_config(url), "0001")
    spec = '{"metrics": {"a": "sum", "n": "count"}, "derived": {"mean": "a / n"}}'
    result = (
        '{"status": "complete", "metrics": {"a": {"value": "Infinity"}, "n": {"value": 2.0},'
        ' "mean": {"value": null}}, "ranks_committed": [0], "ranks_missing": [],'
        ' "missing_fragments": {}, "received": 1, "expected": 1}'
    )
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO runs VALUES (1, 'old', 1, ?, 60.0, 0.0)", (spec,))
        conn.exec_driver_sql("INSERT INTO metrics VALUES (1, 0, 'a'), (1, 1, 'n')")
        conn.exec_driver_sql(
            "INSERT INTO steps VALUES (1, 7, 'complete', 1, 1, 1, 1, 0, 0.0, 60.0, 1.0, ?)",
            (result,),
        )
    command.upgrade(alembic_config(url), "head")
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT m.col, m.name, v.step, v.value, v.state FROM step_values v "
            "JOIN metrics m ON m.run_id = v.run_id AND m.col = v.col ORDER BY m.col"
        ).all()
    engine.dispose()
    assert [tuple(r) for r in rows] == [
        (-1, "mean", 7, None, 2),
        (0, "a", 7, math.inf, 0),
        (1, "n", 7, 2.0, 0),
    ]
