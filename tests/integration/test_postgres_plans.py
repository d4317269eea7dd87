"""PostgreSQL's ingest reads look each (step, rank) pair up by its key, whatever the
tables held when the plan was made. psycopg prepares a statement after a few runs, and
a plan made while a run's tables were empty (a sequential scan is cheapest then) would
stay for the connection's life: at 4096 ranks it read whole tables for every pair,
14 ms of database CPU a batch (bench/README.md, Scale)."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy as sa

from steptally.service.store.dialect import dialect_for
from steptally.service.store.engine import make_engine
from steptally.service.store.sql_statement import PIPELINE, pairs_params

pytestmark = pytest.mark.postgres


@pytest.fixture
def writer(postgres_url: str) -> Iterator[psycopg.Connection]:
    """A writer's connection, set up as the store sets it up, over empty, analysed
    tables (what a new database's first batches meet)."""
    from tests.integration.conftest import _empty

    _empty(postgres_url)
    engine = make_engine(postgres_url)
    try:
        with engine.connect() as conn:
            dialect_for(engine).writer_connection(conn)
            driver = conn.connection.driver_connection
            assert isinstance(driver, psycopg.Connection)
            driver.execute(
                "INSERT INTO runs (id, name, world_size, spec, step_timeout_s, created_at) "
                "VALUES (1, 'r', 256, '{}', 60, 0)"
            )
            driver.execute("ANALYZE")
            driver.commit()
            yield driver
            driver.rollback()
    finally:
        engine.dispose()


def test_the_pairs_read_is_one_key_lookup_a_table_in_a_plan_made_on_empty_tables(
    writer: psycopg.Connection,
) -> None:
    text = PIPELINE.pairs_of
    for i, name in enumerate(("step", "rank", "run"), start=1):
        text = text.replace(f"%({name})b", f"${i}")
    params = pairs_params(1, [(3, 5), (3, 6), (7, 255)])
    args = (params["step"], params["rank"], params["run"])
    writer.execute("SET plan_cache_mode = force_generic_plan")  # the plan kept once prepared
    writer.execute(f"PREPARE pair_read AS {text}")
    try:
        literal = psycopg.ClientCursor(writer)  # EXPLAIN EXECUTE takes no bound parameters
        plan = [r[0] for r in literal.execute("EXPLAIN EXECUTE pair_read(%s, %s, %s)", args)]
        rows = literal.execute("EXECUTE pair_read(%s, %s, %s)", args).fetchall()
    finally:
        writer.execute("DEALLOCATE pair_read")
    assert sorted(tuple(r[:2]) for r in rows) == [(3, 5), (3, 6), (7, 255)]
    assert not [line for line in plan if "Seq Scan" in line], plan
    scans = [line.split(" on ")[1].split()[0] for line in plan if "Index Scan" in line]
    assert sorted(scans) == ["commits", "fragments", "partials"], plan


def test_other_connections_keep_the_planner_as_it_is(postgres_url: str) -> None:
    engine = sa.create_engine(postgres_url)
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW enable_seqscan").scalar() == "on"
    finally:
        engine.dispose()
