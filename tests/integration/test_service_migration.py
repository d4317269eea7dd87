"""The migrated schema matches the models, and the service refuses an outdated one."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
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
from steptally.service.store.migration import upgrade
from steptally.service.store.models import Base
from steptally.service.store.sql import SqlStore


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
