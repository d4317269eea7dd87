"""Shared test setup: the ASGI test client and where the real peers are.

PostgreSQL is expected on 127.0.0.1:5432 with trust auth (``scripts/ensure-services.sh``
starts it); ``STEPTALLY_TEST_PG_ADMIN`` overrides the admin URL. Integration tests
create a database of their own from it and drop it at the end.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.served import ServedService

# the verl plugin's tests need verl, which has a venv of its own (`make test-verl`)
collect_ignore = ["verl_plugin"] if importlib.util.find_spec("verl") is None else []

# starlette warns once, when first imported, that it prefers the httpx2 package; httpx
# works, so import it here quietly and every later import finds it loaded
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*httpx2.*")
    import fastapi.testclient  # noqa: F401


CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """Headless Chromium (the system's) driven by Playwright, one for the whole session:
    Playwright's sync API runs one event loop a thread, so every test shares it."""
    from playwright.sync_api import sync_playwright  # not in the verl venv

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture(scope="session")
def pg_admin_url() -> str:
    """A URL of an existing PostgreSQL database from which test databases are created."""
    return os.environ.get(
        "STEPTALLY_TEST_PG_ADMIN", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    )


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., ServedService]]:
    """``serve(database_url)``: a started ``steptally serve`` subprocess, stopped at the end."""
    started: list[ServedService] = []

    def start(database_url: str, *extra: str) -> ServedService:
        service = ServedService(database_url, tmp_path / f"serve-{len(started)}.log")
        started.append(service)
        return service.start(*extra)

    yield start
    for service in started:
        service.stop(signal.SIGKILL)
