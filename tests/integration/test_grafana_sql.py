"""Every SQL query of the built dashboards (panels and variables) against a real
PostgreSQL migrated with Alembic, with runs seeded through the service: exact rows.

Run ``grpo`` has a complete step, a partial step (rank 1 missing), a step
finalised partial and then complete at revision 2, an undefined mean (0 / 0) and
a NaN; run ``long`` has twenty steps with a spike up and one down, to check that
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
    api.register("grpo", world_size=2, derived={"mean": "a / n"}, step_timeout_s=10)
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
    assert titles == ["$metric by step", "Partial and revised steps", "Steps by status"]
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
            (0, 1.5, None, None),
            (1, 2.0, 2.0, None),
            (2, 3.0, None, 3.0),
            (3, None, None, None),  # 0 / 0: undefined
            (4, None, None, None),  # NaN
        ], points
    a = _values(seeded, "grpo", "a", "1000")
    assert a == [
        (0, 3.0, None, None),
        (1, 4.0, 4.0, None),
        (2, 6.0, None, 6.0),
        (3, 0.0, None, None),
        (4, None, None, None),
    ]


def test_buckets_keep_each_least_and_greatest_value(seeded: sa.Engine) -> None:
    assert _values(seeded, "long", "a", "2") == [
        (0, 0.0, None, None),
        (7, 100.0, None, None),
        (12, -50.0, None, None),
        (19, 19.0, None, None),
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
