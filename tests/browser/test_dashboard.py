"""The built-in dashboard in real headless Chromium against a real running service."""

from __future__ import annotations

from typing import Any

import pytest
from browser.seeding import Seeder
from playwright.sync_api import Page, expect

pytestmark = pytest.mark.browser

SPEC: dict[str, Any] = {
    "metrics": {"ratio_num": "sum", "actor_tokens": "count", "ratio_max": "max"},
    "derived": {"probs_ratio": "ratio_num / actor_tokens"},
}


def wave(step: int, rank: int) -> dict[str, Any]:
    return {"ratio_num": 0.5 + step / 100 + rank / 1000, "actor_tokens": 1, "ratio_max": 1.0 + step}


def test_runs_list_shows_seeded_runs_with_working_links(page: Page, seed: Seeder) -> None:
    seed.run("list-alpha", 2, **SPEC)
    seed.run("list-beta", 4, **SPEC)
    seed.steps("list-alpha", range(3), 2, wave)
    page.goto("/")
    alpha = page.locator('tr[data-run="list-alpha"]')
    expect(alpha).to_be_visible()
    expect(page.locator('tr[data-run="list-beta"] td').nth(1)).to_have_text("4")
    expect(alpha.locator("td").nth(3)).to_have_text("3")
    alpha.get_by_role("link", name="list-alpha").click()
    expect(page).to_have_url("/runs/list-alpha")
    expect(page.locator("#run-name")).to_have_text("list-alpha")


def test_forty_steps_draw_forty_points_per_chart(page: Page, seed: Seeder) -> None:
    seed.run("forty", 2, **SPEC)
    seed.steps("forty", range(40), 2, wave)
    page.goto("/runs/forty")
    for metric in ("probs_ratio", "ratio_num", "actor_tokens", "ratio_max"):
        card = page.locator(f'.card[data-metric="{metric}"]')
        expect(card).to_have_attribute("data-state", "ready")
        xs = page.evaluate(f"steptally.charts.get('{metric}').uplot.data[0]")
        assert xs == list(range(40))
    values = page.evaluate("steptally.charts.get('ratio_max').uplot.data[1]")
    assert values == [1.0 + s for s in range(40)]


def test_unknown_run_is_a_404_page_with_a_link_back(page: Page) -> None:
    answer = page.goto("/runs/no-such-run")
    assert answer is not None and answer.status == 404
    expect(page.locator("#not-found h2")).to_contain_text("no-such-run")
    page.locator("#back-to-runs").click()
    expect(page).to_have_url("/")
    expect(page.locator("body")).to_have_attribute("data-state", "ready")


def test_assets_are_served_with_cache_control(page: Page, seed: Seeder) -> None:
    seed.run("cached", 1, **SPEC)
    seen: dict[str, str | None] = {}
    page.on(
        "response",
        lambda r: seen.__setitem__(r.url.split("/dashboard/")[-1], r.headers.get("cache-control")),
    )
    page.goto("/runs/cached")
    expect(page.locator('.card[data-metric="probs_ratio"]')).to_have_attribute(
        "data-state", "ready"
    )
    assert seen["vendor/uPlot.iife.min.js?v=1.6.32"] == "public, max-age=31536000, immutable"
    assert seen["vendor/uPlot.min.css?v=1.6.32"] == "public, max-age=31536000, immutable"
    assert seen["static/run.js"] == "no-cache"
    assert seen["static/chart.js"] == "no-cache"
