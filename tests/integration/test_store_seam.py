"""The app's one store seam: ``create_app(settings, store=...)`` serves over the store
it is given (the factory's otherwise), asks it whether it is ready, and closes it."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from steptally.service.app import create_app
from steptally.service.errors import NotMigrated
from steptally.service.settings import Settings
from steptally.service.store.factory import open_store
from steptally.service.store.protocol import Store
from steptally.service.store.sql import SqlStore


class Watched:
    """A store that delegates to a real one and notes readiness checks and closing."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.ready_checks = 0
        self.migrated = True
        self.closed = False

    def check_ready(self) -> None:
        self.ready_checks += 1
        if not self.migrated:
            raise NotMigrated("the database is at schema version old, not new")
        self.inner.check_ready()

    def close(self) -> None:
        self.closed = True
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_the_app_serves_over_the_store_it_is_given(db_url: str) -> None:
    settings = Settings(database_url=db_url)
    store = Watched(open_store(settings))
    app = create_app(settings, store=store, sweep=False)  # type: ignore[arg-type]
    assert app.state.store is store
    with TestClient(app) as client:
        assert store.ready_checks == 1  # at start
        body = {"name": "r", "world_size": 1, "metrics": {"a": "sum"}, "step_timeout_s": 60}
        assert client.post("/v1/runs", json=body).status_code == 201
        assert store.inner.get_run("r") is not None  # written through the given store
        assert client.get("/readyz").json() == {"status": "ready"}
        assert store.ready_checks == 2
        store.migrated = False
        answer = client.get("/readyz")
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "not_ready"
        assert answer.json()["error"]["message"] == (
            "the database is at schema version old, not new"
        )
    assert store.closed


def test_without_a_store_the_app_opens_the_one_its_settings_describe(db_url: str) -> None:
    app = create_app(Settings(database_url=db_url), sweep=False)
    with TestClient(app):
        assert type(app.state.store) is SqlStore
        assert app.state.store.url == db_url
