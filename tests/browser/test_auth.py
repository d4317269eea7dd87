"""The dashboard with auth on: a read token given through the form or as /#token=,
kept in the tab and sent with every fetch; the live stream authorised by its cookie;
a token bound to another run asked to be replaced."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from browser.seeding import SPEC, wave
from playwright.sync_api import Browser, Page, expect
from support.served import free_port

from steptally.service.auth.tokens import Scope, TokenStore
from steptally.service.embedded import EmbeddedServer
from steptally.service.settings import Settings
from steptally.service.store.engine import make_engine

pytestmark = pytest.mark.browser
RUN = "guarded"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A service with auth on, one run with three steps, and its tokens."""
    url = f"sqlite:///{tmp_path_factory.mktemp('auth') / 'steptally.sqlite3'}"
    settings = Settings(database_url=url, port=free_port(), sweep_interval_s=0.1, auth=True)
    with EmbeddedServer(settings) as server:
        tokens = TokenStore(make_engine(url))
        made = {
            "url": server.url,
            "read": tokens.create(Scope.READ).secret,
            "ingest": tokens.create(Scope.INGEST, run=RUN).secret,
            "other": tokens.create(Scope.READ, run="another-run").secret,
        }
        tokens.close()
        with httpx.Client(base_url=server.url, timeout=30) as http:
            made["http"] = http
            headers = {"Authorization": f"Bearer {made['ingest']}"}
            body = {"name": RUN, "world_size": 2, **SPEC, "step_timeout_s": 60}
            assert http.post("/v1/runs", json=body, headers=headers).status_code == 201
            post_steps(made, range(3))
            yield made


def post_steps(guarded: dict[str, Any], steps: range) -> None:
    fragments = [
        {"step": s, "rank": r, "seq": 0, "values": wave(s, r)} for s in steps for r in range(2)
    ]
    commits = [{"step": s, "rank": r, "fragments": 1} for s in steps for r in range(2)]
    headers = {"Authorization": f"Bearer {guarded['ingest']}"}
    answer = guarded["http"].post(
        f"/v1/runs/{RUN}/fragments",
        json={"fragments": fragments, "commits": commits},
        headers=headers,
    )
    assert answer.status_code == 200, answer.text


@pytest.fixture
def tab(browser: Browser, guarded: dict[str, Any]) -> Iterator[Page]:
    context = browser.new_context(base_url=guarded["url"], viewport={"width": 1440, "height": 900})
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda exc: errors.append(str(exc)))
    opened.set_default_timeout(10_000)
    yield opened
    context.close()
    assert errors == [], f"script errors on the page: {errors}"


def test_the_form_takes_a_read_token(tab: Page, guarded: dict[str, Any]) -> None:
    tab.goto("/")
    form = tab.locator("#signin")
    expect(form).to_contain_text("This service needs a read token.")
    expect(tab.locator("#runs tbody tr")).to_have_count(0)
    form.locator("input[name=token]").fill(guarded["read"])
    form.locator("button").click()
    expect(tab.locator("body")).to_have_attribute("data-state", "ready")
    expect(tab.locator(f'#runs tbody tr[data-run="{RUN}"]')).to_have_count(1)
    expect(tab.locator("#signin")).to_have_count(0)
    assert guarded["read"] not in tab.url


def test_a_token_in_the_fragment_reads_the_run_live(tab: Page, guarded: dict[str, Any]) -> None:
    sent: list[dict[str, str]] = []
    tab.on("request", lambda r: "/series/" in r.url and sent.append(r.headers))
    tab.goto(f"/runs/{RUN}#token={guarded['read']}")
    assert tab.url.endswith(f"/runs/{RUN}")  # the token left the address bar at once
    expect(tab.locator("body")).to_have_attribute("data-live", "open")  # the cookie
    card = tab.locator('.card[data-metric="ratio_max"]')
    expect(card).to_have_attribute("data-points", "3")
    assert sent and all(h.get("authorization") == f"Bearer {guarded['read']}" for h in sent)
    post_steps(guarded, range(3, 5))
    expect(card).to_have_attribute("data-points", "5")  # live over the event stream
    expect(tab.locator("#signin")).to_have_count(0)


def test_a_token_bound_to_another_run_is_asked_to_be_replaced(
    tab: Page, guarded: dict[str, Any]
) -> None:
    tab.goto(f"/runs/{RUN}#token={guarded['other']}")
    form = tab.locator("#signin")
    expect(form).to_contain_text("This token may not read this.")
    expect(form).to_contain_text("is bound to run 'another-run', not to run 'guarded'")
    expect(tab.locator("body")).to_have_attribute("data-state", "error")
    expect(tab.locator("#run-summary")).to_contain_text("could not load the run: token")
