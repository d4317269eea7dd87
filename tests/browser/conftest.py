"""Fixtures of the dashboard's browser tests: a real service and real headless Chromium.

The service runs in a thread of the test process (uvicorn, as ``steptally demo
--serve`` runs it) on a free port over a fresh SQLite database, with a fast sweeper so
that overdue steps are finalised partial within a fraction of a second. Chromium is
the system's ``/usr/bin/chromium`` driven by Playwright. After every test a screenshot
of its page is saved under ``var/test-artifacts/browser/``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser.seeding import Seeder
from playwright.sync_api import Browser, Page
from support.served import free_port

from steptally.service.embedded import EmbeddedServer
from steptally.service.settings import Settings

ARTIFACTS = Path(__file__).resolve().parents[2] / "var" / "test-artifacts" / "browser"
VIEWPORT = {"width": 1440, "height": 1000}


@pytest.fixture(scope="session")
def service_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    database = tmp_path_factory.mktemp("browser") / "steptally.sqlite3"
    settings = Settings(
        database_url=f"sqlite:///{database}", port=free_port(), sweep_interval_s=0.1
    )
    with EmbeddedServer(settings) as server:
        yield server.url


@pytest.fixture
def seed(service_url: str) -> Iterator[Seeder]:
    seeder = Seeder(service_url)
    yield seeder
    seeder.close()


@pytest.fixture
def page(browser: Browser, service_url: str, request: pytest.FixtureRequest) -> Iterator[Page]:
    """A fresh page on the service; fails the test on any uncaught script error."""
    context = browser.new_context(base_url=service_url, viewport=VIEWPORT)
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda exc: errors.append(str(exc)))
    opened.set_default_timeout(10_000)
    yield opened
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
    opened.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
    context.close()
    assert errors == [], f"script errors on the page: {errors}"
