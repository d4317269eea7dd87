"""PostgreSQL's ingest reads look each (step, rank) pair up by its key, whatever the
table holds: a plan that read whole tables made every batch cost more as a run grew
(a read of the highest seq took 0.8 ms a batch at 2,000 rank-steps, bench/README.md)."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy as sa

from steptally.service.store.sql_statement import PIPELINE, pairs_params

pytestmark = pytest.mark.postgres


@pytest.fixture
def conn(postgres_url: str) -> Iterator[psycopg.Connection]:
    from tests.integration.conftest import _empty

    _empty(postgres_url)
    url = sa.make_url(postgres_url).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(url) as c:
        c.execute(
            "INSERT INTO runs (id, name, world_size, spec, step_timeout_s, created_at) "
            "VALUES (1, 'r', 256, '{}', 60, 0)"
        )
        c.execute(
            "INSERT INTO partials SELECT 1, s, r, 1, '\\x020000' "
            "FROM generate_series(0, 39) s, generate_series(0, 255) r"
        )
        c.execute("INSERT INTO commits SELECT 1, step, rank, 1 FROM partials")
        c.execute(
            "INSERT INTO fragments (run_id, step, rank, seq, values_f64) "
            "SELECT 1, step, rank, 0, '\\x' FROM partials"
        )
        c.execute("ANALYZE")
        c.commit()
        yield c
        c.rollback()


@pytest.mark.parametrize("name", ["pairs_of"])
def test_each_pair_is_one_key_lookup_in_the_generic_plan(
    conn: psycopg.Connection, name: str
) -> None:
    text = getattr(PIPELINE, name)
    params = pairs_params(1, [(3, 5), (3, 6), (7, 255)])
    conn.execute("SET plan_cache_mode = force_generic_plan")  # the plan a prepared one gets
    conn.execute(f"PREPARE pair_read AS {_numbered(text)}")
    try:
        args = (params["step"], params["rank"], params["run"])
        literal = psycopg.ClientCursor(conn)  # EXPLAIN EXECUTE takes no bound parameters
        plan = [r[0] for r in literal.execute("EXPLAIN EXECUTE pair_read(%s, %s, %s)", args)]
        rows = literal.execute("EXECUTE pair_read(%s, %s, %s)", args).fetchall()
        assert sorted(tuple(r[:2]) for r in rows) == [(3, 5), (3, 6), (7, 255)]
    finally:
        conn.execute("DEALLOCATE pair_read")
    assert not [line for line in plan if "Seq Scan" in line], plan
    assert any("Index" in line and "Cond" not in line for line in plan), plan


def _numbered(text: str) -> str:
    """The pipeline text with its named parameters as $1 (step), $2 (rank), $3 (run)."""
    for i, name in enumerate(("step", "rank", "run"), start=1):
        text = text.replace(f"%({name})b", f"${i}")
    return text
