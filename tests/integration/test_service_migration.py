"""The migrated schema matches the models, and the service refuses an outdated one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from fastapi.testclient import TestClient

from steptally.client.algebra import MetricSpec
from steptally.client.wire import decode_batch
from steptally.service.app import create_app
from steptally.service.domain.batch import prepare
from steptally.service.domain.run import RunDraft
from steptally.service.errors import NotMigrated
from steptally.service.settings import Settings
from steptally.service.store.migration import alembic_config, upgrade
from steptally.service.store.models import Base
from steptally.service.store.sql import SqlStore
from tests.integration.conftest import own_database


def test_migrations_match_the_models(db_url: str) -> None:
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            drift = compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()
    assert drift == [], f"the models and the migrations differ: {drift}"


def test_app_refuses_unmigrated_database(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fresh' / 'db.sqlite3'}"
    app = create_app(Settings(database_url=url), sweep=False)
    with pytest.raises(NotMigrated, match="steptally migrate"), TestClient(app):
        pass
    upgrade(url)
    app = create_app(Settings(database_url=url), sweep=False)
    with TestClient(app) as client:
        assert client.get("/readyz").json() == {"status": "ready"}
        assert client.get("/healthz").json() == {"status": "ok"}


def test_outdated_database_names_the_command(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.sqlite3'}"
    upgrade(url)
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = 'old'")
    engine.dispose()
    app = create_app(Settings(database_url=url), sweep=False)
    with pytest.raises(NotMigrated, match="at schema version old"), TestClient(app):
        pass


def test_fragments_stored_before_partial_rows_gain_rows_and_stay_exact(db_url: str) -> None:
    # revision 0008: a pair whose fragments predate partial rows gets a row that holds
    # none of them, so ingest knows they are there and finalisation reads them
    spec = MetricSpec.build({"a": "sum", "n": "count"}, {"m": "a / n"})
    store = SqlStore.from_url(db_url)
    run, _ = store.register_run("legacy", lambda _: RunDraft(2, spec, 60.0), 0.0)

    def batch(frags: list[tuple[int, int, int, float]], commits: list[tuple[int, int, int]]):
        body = {
            "fragments": [
                {"step": s, "rank": r, "seq": q, "values": {"a": a, "n": 1}} for s, r, q, a in frags
            ],
            "commits": [{"step": s, "rank": r, "fragments": n} for s, r, n in commits],
        }
        return prepare(run, decode_batch(body), columnar=False)

    for i, frag in enumerate([(0, 0, 0, 1e17), (0, 0, 1, 3.0), (0, 1, 0, -1e17)]):
        store.ingest(run, batch([frag], []), 1.0 + i)  # one row each: no bundle
    store.ingest(run, batch([], [(0, 0, 2)]), 1.5)
    store.close()
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:  # as a database written before revision 0006 holds it
        conn.exec_driver_sql("DELETE FROM partials")
        conn.exec_driver_sql("ALTER TABLE fragments DROP COLUMN seqs")  # revision 0009's
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '0007'")
    upgrade(db_url)
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT step, rank, fragments, state FROM partials ORDER BY step, rank"
        ).all()
    engine.dispose()
    assert [tuple(r[:3]) for r in rows] == [(0, 0, 0), (0, 1, 0)]
    assert {bytes(r[3]) for r in rows} == {b"\x02\x00\x00"}
    store = SqlStore.from_url(db_url)
    try:
        again = store.ingest(run, batch([(0, 0, 1, 3.0)], []), 2.0)
        assert (again.accepted, again.duplicates) == (0, 1)
        done = store.ingest(run, batch([(0, 1, 1, 0.5)], [(0, 1, 2)]), 3.0)
        assert [(f.step, f.status.value) for f in done.finalised] == [(0, "complete")]
        step = store.get_step(run, 0)
        assert step is not None and step.result is not None
        values = step.result.metrics
        assert (values["a"]["value"], values["n"]["value"]) == (3.5, 4.0)  # 1e17 + 3 - 1e17 + 0.5
    finally:
        store.close()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def unmigrated_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database of its own, no schema in it: SQLite, then PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'own.sqlite3'}"
        return
    admin_url: str = request.getfixturevalue("pg_admin_url")
    with own_database(admin_url, f"steptally_migration_{os.getpid()}") as url:
        yield url


def _step_values(engine: sa.Engine) -> tuple[list[Any], list[Any], list[str]]:
    """The table's rows, its foreign keys and its indexes' names."""
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT run_id, col, step, value, state FROM step_values ORDER BY col, step"
        ).all()
        inspector = sa.inspect(conn)
        keys = inspector.get_foreign_keys("step_values")
        indexes = sorted(str(i["name"]) for i in inspector.get_indexes("step_values"))
    return [tuple(r) for r in rows], keys, indexes


def test_step_values_lose_their_run_key_and_keep_their_rows(unmigrated_url: str) -> None:
    # revision 0013: a finalisation's values are written without a check of their run
    # each; the rows written before are kept, as are the table's key order and index
    config = alembic_config(unmigrated_url)
    command.upgrade(config, "0012")
    engine = sa.create_engine(unmigrated_url)
    rows = [(1, 0, 5, 1.5, 0), (1, 0, 6, None, 1), (1, 1, 5, -2.25, 0), (1, -1, 5, None, 2)]
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO runs (id, name, world_size, spec, step_timeout_s, created_at) "
                "VALUES (1, 'old', 2, '{}', 60.0, 0.0)"
            )
            conn.execute(
                sa.text(
                    "INSERT INTO step_values (run_id, col, step, value, state) "
                    "VALUES (:r, :c, :s, :v, :st)"
                ),
                [dict(zip(("r", "c", "s", "v", "st"), row, strict=True)) for row in rows],
            )
        before, keys, indexes = _step_values(engine)
        assert [k["referred_table"] for k in keys] == ["runs"]
        command.upgrade(config, "0013")
        after, keys, after_indexes = _step_values(engine)
        assert keys == []
        assert after == before == sorted(rows, key=lambda r: (r[1], r[2]))
        assert after_indexes == indexes == ["ix_step_values_odd"]
        if engine.dialect.name == "sqlite":
            with engine.connect() as conn:
                sql = conn.exec_driver_sql(
                    "SELECT sql FROM sqlite_master WHERE name = 'step_values'"
                ).scalar_one()
            assert "WITHOUT ROWID" in sql
        with engine.begin() as conn:  # a value of a run that is not there is not refused now
            conn.exec_driver_sql(
                "INSERT INTO step_values (run_id, col, step, value, state) VALUES (9, 0, 0, 1.0, 0)"
            )
            conn.exec_driver_sql("DELETE FROM step_values WHERE run_id = 9")
        command.downgrade(config, "0012")
        again, keys, _ = _step_values(engine)
        assert [k["referred_table"] for k in keys] == ["runs"]
        assert again == before
    finally:
        engine.dispose()


def test_a_run_deleted_by_hand_as_the_deploy_guide_says_leaves_no_row(db_url: str) -> None:
    # docs/deploy.md: a pair's rows and a step's values have no foreign key to their run,
    # so whoever deletes a run deletes them too; the rest goes with the run
    spec = MetricSpec.build({"a": "sum", "n": "count"}, {"m": "a / n"})
    store = SqlStore.from_url(db_url)
    try:
        run, _ = store.register_run("gone", lambda _: RunDraft(1, spec, 60.0), 0.0)
        body = {
            "fragments": [{"step": 0, "rank": 0, "seq": 0, "values": {"a": 2.0, "n": 1}}],
            "commits": [{"step": 0, "rank": 0, "fragments": 1}],
        }
        done = store.ingest(run, prepare(run, decode_batch(body), columnar=False), 1.0)
        assert [f.status.value for f in done.finalised] == ["complete"]
        tables = ("fragments", "commits", "partials", "step_values", "steps", "metrics", "runs")
        with store.engine.begin() as conn:
            counts = {
                t: conn.exec_driver_sql(f"SELECT count(*) FROM {t}").scalar_one() for t in tables
            }
            assert all(counts.values()), counts  # the run has a row in each
            for table in ("fragments", "commits", "partials", "step_values"):
                conn.exec_driver_sql(f"DELETE FROM {table} WHERE run_id = {run.id}")
            conn.exec_driver_sql(f"DELETE FROM runs WHERE id = {run.id}")
        with store.engine.connect() as conn:
            left = {
                t: conn.exec_driver_sql(f"SELECT count(*) FROM {t}").scalar_one() for t in tables
            }
        assert set(left.values()) == {0}, left
    finally:
        store.close()
