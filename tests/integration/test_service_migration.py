"""The migrated schema matches the models, and the service refuses an outdated one."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from fastapi.testclient import TestClient

from steptally.service.app import create_app
from steptally.service.errors import NotMigrated
from steptally.service.settings import Settings
from steptally.service.store.migration import upgrade
from steptally.service.store.models import Base


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
