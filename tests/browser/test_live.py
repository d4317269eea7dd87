"""The run page follows its run over the event stream: no reload, no series refetch."""

from __future__ import annotations

import re

import pytest
from browser.page_state import (
    BREACH_MARKERS,
    PARTIAL_MARKERS,
    REVISED_MARKERS,
    column,
    marked_steps,
    wait_for_marked,
)
from browser.seeding import SPEC, Seeder, wave
from playwright.sync_api import Page, expect

pytestmark = pytest.mark.browser


def test_steps_posted_while_the_page_is_open_appear_without_a_reload(
    page: Page, seed: Seeder
) -> None:
    seed.run("livey", 2, **SPEC, step_timeout_s=0.3)
    seed.steps("livey", range(3), 2, wave)
    series_requests: list[str] = []
    page.on("request", lambda r: "/series/" in r.url and series_requests.append(r.url))
    page.goto("/runs/livey")
    expect(page.locator("body")).to_have_attribute("data-live", "open")
    card = page.locator('.card[data-metric="ratio_max"]')
    expect(card).to_have_attribute("data-points", "3")
    fetched = len(series_requests)
    page.evaluate("window.sameDocument = true")

    seed.steps("livey", range(3, 5), 2, wave)
    expect(card).to_have_attribute("data-points", "5")
    summary = page.locator("#run-summary")
    expect(summary).to_contain_text("2 ranks · 5 complete · 0 partial · 0 open · last step 4")
    assert column(page, "ratio_max", 1) == [1.0 + s for s in range(5)]

    seed.post("livey", [{"step": 5, "rank": 0, "seq": 0, "values": wave(5, 0)}], [])
    seed.post("livey", [], [{"step": 5, "rank": 0, "fragments": 1}])
    seed.wait_for_status("livey", 5, "partial")
    page.wait_for_function("steptally.heatmap.cellState(5, 1) === 'missing'")
    expect(card).to_have_attribute("data-points", "6")
    expect(summary).to_contain_text("5 complete · 1 partial · 0 open · last step 5")
    page.evaluate("steptally.select(5)")
    detail = page.locator("#detail")
    expect(detail).to_have_attribute("data-revision", "1")
    expect(page.locator("#detail-missing")).to_have_text("1")

    late = {"step": 5, "rank": 1, "seq": 0, "values": wave(5, 1)}
    seed.post("livey", [late], [{"step": 5, "rank": 1, "fragments": 1}])
    page.wait_for_function("steptally.heatmap.cellState(5, 1) === 'late'")
    wait_for_marked(page, "ratio_max", REVISED_MARKERS, [5])
    assert marked_steps(page, "ratio_max", PARTIAL_MARKERS) == []
    expect(detail).to_have_attribute("data-revision", "2")
    expect(page.locator("#detail-status")).to_have_text("complete")
    expect(page.locator("#detail-late")).to_have_text("1")
    expect(summary).to_contain_text("6 complete · 0 partial · 0 open · last step 5")
    assert page.evaluate("window.sameDocument") is True
    assert len(series_requests) == fetched


def test_alert_breaches_are_ringed_counted_and_explained_live(page: Page, seed: Seeder) -> None:
    rules = [
        {"name": "ratio_max_high", "metric": "ratio_max", "above": 3.5},
        {"name": "ranks", "missing_ranks_above": 0},
    ]
    seed.run("alerty", 2, **SPEC, alerts=rules)
    seed.steps("alerty", range(6), 2, wave)  # ratio_max is 1 + step: steps 3, 4, 5 breach
    page.goto("/runs/alerty")
    expect(page.locator("body")).to_have_attribute("data-live", "open")
    card = page.locator('.card[data-metric="ratio_max"]')
    expect(card).to_have_attribute("data-state", "ready")
    assert marked_steps(page, "ratio_max", BREACH_MARKERS) == [3, 4, 5]
    assert column(page, "ratio_max", BREACH_MARKERS)[3:] == [4.0, 5.0, 6.0]  # on the points
    assert marked_steps(page, "probs_ratio", BREACH_MARKERS) == []  # no rule on it
    pill = page.locator('.alert-rule[data-rule="ratio_max_high"]')
    expect(pill).to_have_attribute("data-count", "3")
    expect(pill).to_have_class(re.compile(r"\bbroken\b"))
    expect(page.locator('.alert-rule[data-rule="ranks"]')).to_have_attribute("data-count", "0")
    expect(card.locator(".card-foot")).to_contain_text("3 breaching")
    detail = page.locator("#detail")
    pill.click()  # the first step that broke the rule, then the next
    expect(detail).to_have_attribute("data-step", "3")
    pill.click()
    expect(detail).to_have_attribute("data-step", "4")
    expect(page).to_have_url(re.compile(r"step=4"))

    seed.steps("alerty", range(6, 7), 2, wave)  # arrives over the event stream
    wait_for_marked(page, "ratio_max", BREACH_MARKERS, [3, 4, 5, 6])
    expect(pill).to_have_attribute("data-count", "4")
    page.evaluate("steptally.select(6)")
    row = page.locator('#detail-breaches tr[data-rule="ratio_max_high"]')
    expect(row).to_contain_text("7")  # the value checked: 1 + 6
    expect(row).to_contain_text("> 3.5")
