"""Every SQL query of the built dashboards (panels and variables) against a real
PostgreSQL migrated with Alembic, with runs seeded through the service: exact rows.

Run ``grpo`` has a complete step, a partial step (rank 1 missing), a step
finalised partial and then complete at revision 2, an undefined mean (0 / 0) and
a NaN, and alert rules that the partial steps, the revised step's mean and the NaN
break; run ``long`` has twenty steps with a spike up and one down, to check that
the bucketing keeps the least and greatest value of every bucket.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa
from support import grafana

pytestmark = [pytest.mark.postgres]

Api = Any  # the `api` fixture of conftest.py
T0 = 1_000_000.0  # the test clock's start


@pytest.fixture
def db_url(postgres_url: str, empty_database: Any) -> str:
    """PostgreSQL only: Grafana reads the service's PostgreSQL database."""
    empty_database(postgres_url)
    return postgres_url


@pytest.fixture
def seeded(api: Api, app: Any, clock: Any, db_url: str) -> Iterator[sa.Engine]:
    rules = [
        {"name": "mean_high", "metric": "mean", "above": 2.5},
        {"name": "mean_nan", "metric": "mean", "non_finite": True},
        {"name": "ranks", "missing_ranks_above": 0},
    ]
    grpo = {"world_size": 2, "metrics": {"a": "sum", "n": "count"}, "derived": {"mean": "a / n"}}
    body = {"name": "grpo", **grpo, "step_timeout_s": 10, "alerts": rules}
    assert api.client.post("/v1/runs", json=body).status_code == 201
    api.register("other", world_size=1, metrics={"x": "max"})
    api.register("long", world_size=1, metrics={"a": "sum"})
    both = [(0, 0, 1), (0, 1, 1)]
    api.send([(0, 0, 0, {"a": 1.0, "n": 1}), (0, 1, 0, {"a": 2.0, "n": 1})], both, "grpo")
    api.send([(1, 0, 0, {"a": 4.0, "n": 2})], [(1, 0, 1)], "grpo")
    api.send([(2, 0, 0, {"a": 1.0, "n": 1})], [(2, 0, 1)], "grpo")
    step3 = [(3, 0, 0, {"a": 0.0, "n": 0}), (3, 1, 0, {"a": 0.0, "n": 0})]
    api.send(step3, [(3, r, 1) for r in (0, 1)], "grpo")
    step4 = [(4, 0, 0, {"a": "NaN", "n": 1}), (4, 1, 0, {"a": 1.0, "n": 1})]
    api.send(step4, [(4, r, 1) for r in (0, 1)], "grpo")
    clock.now += 10
    assert [(d.step, d.status.value) for d in app.state.service.sweep()] == [
        (1, "partial"),
        (2, "partial"),
    ]
    clock.now += 5
    late = api.send([(2, 1, 0, {"a": 5.0, "n": 1})], [(2, 1, 1)], "grpo").json()
    assert late["finalised"] == [{"step": 2, "status": "complete", "revision": 2}]
    spikes = {7: 100.0, 12: -50.0}
    for step in range(20):
        api.send([(step, 0, 0, {"a": spikes.get(step, float(step))})], [(step, 0, 1)], "long")
    engine = sa.create_engine(db_url)
    yield engine
    engine.dispose()


def _rows(engine: sa.Engine, text: str) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(row) for row in conn.exec_driver_sql(text).all()]


def _panel_sql(title_start: str) -> tuple[str, dict[str, Any]]:
    (found,) = [
        (target["rawSql"], board)
        for _, title, target, board in grafana.targets(grafana.POSTGRES)
        if title.startswith(title_start)
    ]
    return found


def _values(engine: sa.Engine, run: str, metric: str, points: str) -> list[tuple[Any, ...]]:
    text, board = _panel_sql("$metric by step")
    values = {"run": [run], "metric": [metric], "points": [points]}
    return _rows(engine, grafana.sql(text, board, values))


def test_every_sql_query_is_a_panel_or_variable_checked_here() -> None:
    titles = sorted(title for _, title, *_ in grafana.targets(grafana.POSTGRES))
    assert titles == [
        "$metric by step",
        "Alert breaches",
        "Partial and revised steps",
        "Steps by status",
    ]
    assert [a["name"] for _, a, _ in grafana.annotations(grafana.POSTGRES)] == ["Alert breaches"]
    names = sorted(v["name"] for _, v, _ in grafana.query_variables(grafana.POSTGRES))
    assert names == ["metric", "run"]


def test_variables_list_runs_and_the_metrics_of_run(seeded: sa.Engine) -> None:
    found = {}
    for _, variable, board in grafana.query_variables(grafana.POSTGRES):
        text = grafana.sql(variable["query"], board, {"run": ["grpo"]})
        found[variable["name"]] = [row[0] for row in _rows(seeded, text)]
    assert found == {"run": ["grpo", "long", "other"], "metric": ["a", "mean", "n"]}


def test_values_by_step_with_partial_and_revised_marked(seeded: sa.Engine) -> None:
    for points in ("1000", "2"):  # with 2 buckets, step 1 stays only for being partial
        mean = _values(seeded, "grpo", "mean", points)
        assert mean == [
            (0, 1.5, None, None, None),
            (1, 2.0, 2.0, None, None),  # its rank breach is on no metric
            (2, 3.0, None, 3.0, 3.0),  # revision 2 broke mean_high
            (3, None, None, None, None),  # 0 / 0: undefined
            (4, None, None, None, None),  # NaN: broke mean_nan, drawn as a gap
        ], points
    a = _values(seeded, "grpo", "a", "1000")
    assert a == [
        (0, 3.0, None, None, None),
        (1, 4.0, 4.0, None, None),
        (2, 6.0, None, 6.0, None),  # no rule on a
        (3, 0.0, None, None, None),
        (4, None, None, None, None),
    ]


def test_buckets_keep_each_least_and_greatest_value(seeded: sa.Engine) -> None:
    assert _values(seeded, "long", "a", "2") == [
        (0, 0.0, None, None, None),
        (7, 100.0, None, None, None),
        (12, -50.0, None, None, None),
        (19, 19.0, None, None, None),
    ]
    assert len(_values(seeded, "long", "a", "1000")) == 20
    assert _values(seeded, "grpo", "no-such-metric", "1000") == []


def test_partial_and_revised_steps_with_their_missing_ranks(seeded: sa.Engine) -> None:
    text, board = _panel_sql("Partial and revised steps")
    rows = _rows(seeded, grafana.sql(text, board, {"run": ["grpo"]}))
    at = [datetime.fromtimestamp(T0 + s, tz=UTC) for s in (10, 15)]
    assert rows == [(1, "partial", 1, 1, "1", at[0]), (2, "complete", 2, 0, "", at[1])]
    assert _rows(seeded, grafana.sql(text, board, {"run": ["long"]})) == []


def test_steps_by_status(seeded: sa.Engine, api: Api) -> None:
    api.send([(5, 0, 0, {"a": 1.0, "n": 1})], run="grpo")  # step 5 stays open
    text, board = _panel_sql("Steps by status")
    rows = _rows(seeded, grafana.sql(text, board, {"run": ["grpo"]}))
    assert rows == [("complete", 4, 1), ("open", 1, 0), ("partial", 1, 0)]
    assert _rows(seeded, grafana.sql(text, board, {"run": ["long"]})) == [("complete", 20, 0)]


def test_alert_breaches_table_and_annotations(seeded: sa.Engine) -> None:
    text, board = _panel_sql("Alert breaches")
    rows = _rows(seeded, grafana.sql(text, board, {"run": ["grpo"]}))
    at = {s: datetime.fromtimestamp(T0 + s, tz=UTC) for s in (0, 10, 15)}
    assert rows == [
        (1, "ranks", "missing_ranks_above", "ranks", "1.0", "0", None, 1, at[10]),
        (2, "mean_high", "above", "mean", "3.0", "2.5", None, 2, at[15]),
        (2, "ranks", "missing_ranks_above", "ranks", "1.0", "0", None, 1, at[10]),
        (4, "mean_nan", "non_finite", "mean", "NaN", None, None, 1, at[0]),
    ]
    assert _rows(seeded, grafana.sql(text, board, {"run": ["long"]})) == []

    ((_, annotation, live),) = grafana.annotations(grafana.POSTGRES)
    query = annotation["target"]["rawSql"]
    window = (T0 - 60, T0 + 60)
    for chosen in (["grpo"], ["$__all"], ["grpo", "other"]):
        found = _rows(seeded, grafana.sql(query, live, {"run": chosen}, window))
        assert found == [
            ((T0 + 0) * 1000, "grpo step 4: mean_nan (mean = NaN)", "grpo,mean_nan"),
            ((T0 + 10) * 1000, "grpo step 1: ranks (missing ranks = 1.0)", "grpo,ranks"),
            ((T0 + 10) * 1000, "grpo step 2: ranks (missing ranks = 1.0)", "grpo,ranks"),
            ((T0 + 15) * 1000, "grpo step 2: mean_high (mean = 3.0)", "grpo,mean_high"),
        ], chosen
    assert _rows(seeded, grafana.sql(query, live, {"run": ["other"]}, window)) == []
    early = (T0 - 60, T0 + 5)  # the dashboard's time range filters them
    assert len(_rows(seeded, grafana.sql(query, live, {"run": ["grpo"]}, early))) == 1
