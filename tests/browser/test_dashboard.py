"""The built-in dashboard in real headless Chromium against a real running service."""

from __future__ import annotations

import re

import pytest
from browser.page_state import (
    FIRST_OVERLAY,
    NON_FINITE_MARKERS,
    PARTIAL_MARKERS,
    column,
    marked_steps,
)
from browser.seeding import SPEC, Seeder, wave
from playwright.sync_api import Page, expect

pytestmark = pytest.mark.browser


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
    assert column(page, "ratio_max", 1) == [1.0 + s for s in range(40)]


def test_unknown_run_is_a_404_page_with_a_link_back(page: Page) -> None:
    answer = page.goto("/runs/no-such-run")
    assert answer is not None and answer.status == 404
    expect(page.locator("#not-found h2")).to_contain_text("no-such-run")
    page.locator("#back-to-runs").click()
    expect(page).to_have_url("/")
    expect(page.locator("body")).to_have_attribute("data-state", "ready")
    answer = page.goto("/runs/%3Cb%3Ebold")
    assert answer is not None and answer.status == 404
    expect(page.locator("#not-found h2")).to_contain_text("“<b>bold”")
    expect(page.locator("#not-found b")).to_have_count(0)


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


def test_step_detail_shows_exact_values_where_a_float_sum_differs(page: Page, seed: Seeder) -> None:
    seed.run("exact", 2, **SPEC, step_timeout_s=60)
    seed.post(
        "exact",
        [
            {
                "step": 0,
                "rank": 0,
                "seq": 0,
                "values": {"ratio_num": 3.0, "actor_tokens": 3, "ratio_max": 1.2},
            },
            {
                "step": 0,
                "rank": 1,
                "seq": 0,
                "values": {"ratio_num": 1e17, "actor_tokens": 1, "ratio_max": "Infinity"},
            },
            {"step": 0, "rank": 1, "seq": 1, "values": {"ratio_num": -1e17, "actor_tokens": 0}},
        ],
        [{"step": 0, "rank": 0, "fragments": 1}, {"step": 0, "rank": 1, "fragments": 2}],
    )
    assert 3.0 + 1e17 - 1e17 == 0.0  # what adding the floats in arrival order gives
    page.goto("/runs/exact?step=0")
    detail = page.locator("#detail")
    expect(detail).to_have_attribute("data-state", "ready")
    value = lambda m: detail.locator(f'tr[data-metric="{m}"] td.value')  # noqa: E731
    expect(value("ratio_num")).to_have_text("3")
    expect(value("probs_ratio")).to_have_text("0.75")
    expect(value("actor_tokens")).to_have_text("4")
    expect(value("ratio_max")).to_have_text("Infinity")
    expect(page.locator("#detail-status")).to_have_text("complete")


def test_clicking_a_chart_point_opens_its_step(page: Page, seed: Seeder) -> None:
    seed.run("clicky", 1, **SPEC)
    seed.steps("clicky", range(40), 1, wave)
    page.goto("/runs/clicky")
    card = page.locator('.card[data-metric="ratio_max"]')
    expect(card).to_have_attribute("data-state", "ready")
    over = card.locator(".u-over")
    box = over.bounding_box()
    assert box is not None
    over.click(position={"x": box["width"] / 2, "y": box["height"] / 2})
    detail = page.locator("#detail")
    expect(detail).to_have_attribute("data-state", "ready")
    step = int(detail.get_attribute("data-step") or "-1")
    assert 15 <= step <= 25
    assert f"step={step}" in page.url
    expect(detail.locator('tr[data-metric="ratio_max"] td.value')).to_have_text(str(1 + step))
    page.keyboard.press("ArrowRight")
    expect(detail).to_have_attribute("data-step", str(step + 1))
    expect(detail.locator('tr[data-metric="ratio_max"] td.value')).to_have_text(str(2 + step))
    page.keyboard.press("Escape")
    expect(detail).to_be_hidden()
    assert "step=" not in page.url


def test_partial_step_is_marked_with_its_missing_rank(page: Page, seed: Seeder) -> None:
    seed.run("gappy", 2, **SPEC, step_timeout_s=0.2)
    seed.steps("gappy", range(5), 2, wave)
    seed.post(
        "gappy",
        [{"step": 5, "rank": 0, "seq": 0, "values": wave(5, 0)}],
        [{"step": 5, "rank": 0, "fragments": 1}],
    )
    seed.wait_for_status("gappy", 5, "partial")
    page.goto("/runs/gappy")
    heat = page.locator("#heatmap")
    expect(heat).to_have_attribute("data-state", "ready")
    assert page.evaluate("steptally.heatmap.cellState(5, 1)") == "missing"
    assert page.evaluate("steptally.heatmap.cellState(5, 0)") == "committed"
    assert page.evaluate("steptally.heatmap.cellState(4, 1)") == "committed"
    expect(page.locator('.card[data-metric="ratio_num"]')).to_have_attribute("data-state", "ready")
    assert marked_steps(page, "ratio_num", PARTIAL_MARKERS) == [5]
    box = heat.bounding_box()
    assert box is not None
    gutter = 34  # px of rank labels left of the cells
    x = gutter + (box["width"] - gutter) * 5.5 / 6
    heat.click(position={"x": x, "y": box["height"] * 3 / 4})
    detail = page.locator("#detail")
    expect(detail).to_have_attribute("data-step", "5")
    expect(page.locator("#detail-status")).to_have_text("partial")
    expect(page.locator("#detail-missing")).to_have_text("1")
    expect(detail.locator('tr[data-rank="1"]')).to_have_attribute("data-state", "missing")


def test_zoom_puts_the_range_in_the_url_and_fetches_it_finer(page: Page, seed: Seeder) -> None:
    seed.run("zoomy", 1, **SPEC)
    seed.steps("zoomy", range(40), 1, wave)
    series_urls: list[str] = []
    page.on("request", lambda r: "/series/ratio_max" in r.url and series_urls.append(r.url))
    page.goto("/runs/zoomy")
    card = page.locator('.card[data-metric="ratio_max"]')
    expect(card).to_have_attribute("data-state", "ready")
    over = card.locator(".u-over")
    box = over.bounding_box()
    assert box is not None
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] * 0.25, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.6, y, steps=5)
    page.mouse.up()
    expect(page).to_have_url(re.compile(r"\?start=\d+&end=\d+$"))
    start, end = (int(n) for n in re.findall(r"\d+", page.url.split("?")[1]))
    assert 8 <= start < end <= 25
    expect(page.locator("#range-label")).to_have_text(f"steps {start} – {end}")
    expect(card).to_have_attribute("data-points", str(end - start + 1))
    assert any(f"start={start}&end={end}&points=" in u for u in series_urls), series_urls
    page.reload()
    expect(card).to_have_attribute("data-points", str(end - start + 1))
    page.locator("#range-reset").click()
    expect(card).to_have_attribute("data-points", "40")
    expect(page).to_have_url("/runs/zoomy")


def test_overlay_draws_another_run_on_the_same_chart(page: Page, seed: Seeder) -> None:
    seed.run("base-run", 1, **SPEC)
    seed.run("other-run", 1, **SPEC)
    seed.steps("base-run", range(10), 1, wave)
    seed.steps("other-run", range(5, 15), 1, lambda s, r: {**wave(s, r), "ratio_max": -s})
    page.goto("/runs/base-run")
    expect(page.locator("#run-names option[value='other-run']")).to_have_count(1)
    page.locator("#overlay-input").fill("other-run")
    page.locator("#overlay-form button[type=submit]").click()
    expect(page).to_have_url("/runs/base-run?overlay=other-run")
    expect(page.locator('#overlay-chips [data-run="other-run"]')).to_be_visible()
    card = page.locator('.card[data-metric="ratio_max"]')
    expect(card).to_have_attribute("data-state", "ready")
    assert column(page, "ratio_max", 0) == list(range(15))
    assert column(page, "ratio_max", 1) == [1.0 + s for s in range(10)] + [None] * 5
    assert column(page, "ratio_max", FIRST_OVERLAY) == [None] * 5 + [-s for s in range(5, 15)]


def hover_step(page: Page, metric: str, step: int) -> str:
    """Move the mouse onto ``step`` of the chart of ``metric``; its readout's text."""
    card = page.locator(f'.card[data-metric="{metric}"]')
    expect(card).to_have_attribute("data-state", "ready")
    x = page.evaluate("([m, s]) => steptally.charts.get(m).uplot.valToPos(s, 'x')", [metric, step])
    box = card.locator(".u-over").bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + x, box["y"] + box["height"] / 2)
    readout = card.locator(".readout")
    expect(readout).to_contain_text(f"step {step} ")
    return readout.inner_text()


def test_hover_shows_the_exact_float64_and_non_finite_values_as_text(
    page: Page, seed: Seeder
) -> None:
    seed.run("hovery", 1, **SPEC)
    row = {"actor_tokens": 1, "ratio_max": 1.0}
    fragments = [
        {"step": 0, "rank": 0, "seq": 0, "values": {**row, "ratio_num": 0.1}},
        {"step": 0, "rank": 0, "seq": 1, "values": {**row, "ratio_num": 0.2}},
        {
            "step": 1,
            "rank": 0,
            "seq": 0,
            "values": {"ratio_num": 0.0, "actor_tokens": 0, "ratio_max": "NaN"},
        },
        {"step": 2, "rank": 0, "seq": 0, "values": {**row, "ratio_num": 0.5}},
    ]
    commits = [{"step": 0, "rank": 0, "fragments": 2}]
    commits += [{"step": s, "rank": 0, "fragments": 1} for s in (1, 2)]
    seed.post("hovery", fragments, commits)
    page.goto("/runs/hovery")
    assert hover_step(page, "ratio_num", 0).split() == ["step", "0", "0.30000000000000004"]
    assert hover_step(page, "probs_ratio", 0).split() == ["step", "0", "0.15000000000000002"]
    assert hover_step(page, "probs_ratio", 1).split() == ["step", "1", "undefined"]
    assert hover_step(page, "ratio_max", 1).split() == ["step", "1", "NaN"]
    assert column(page, "ratio_max", 1) == [1.0, None, 1.0]
    assert column(page, "probs_ratio", 1) == [0.15000000000000002, None, 0.5]
    assert marked_steps(page, "ratio_max", NON_FINITE_MARKERS) == [1]
    assert marked_steps(page, "probs_ratio", NON_FINITE_MARKERS) == [1]
    assert marked_steps(page, "ratio_num", NON_FINITE_MARKERS) == []


def test_the_url_chooses_the_metrics_and_the_picker_writes_them(page: Page, seed: Seeder) -> None:
    seed.run("picky", 1, **SPEC)
    seed.steps("picky", range(4), 1, wave)
    page.goto("/runs/picky?metrics=ratio_max,probs_ratio")
    cards = page.locator(".card")
    expect(cards).to_have_count(2)
    assert cards.evaluate_all("(cs) => cs.map((c) => c.dataset.metric)") == [
        "probs_ratio",
        "ratio_max",
    ]
    expect(page.locator("#metric-count")).to_have_text("2 of 4")
    page.locator("#metric-picker summary").click()
    page.locator('#metric-list label[data-metric="ratio_num"] input').check()
    expect(cards).to_have_count(3)
    expect(page).to_have_url("/runs/picky?metrics=probs_ratio,ratio_num,ratio_max")
    page.locator("#metrics-all").click()
    expect(cards).to_have_count(4)
    expect(page).to_have_url("/runs/picky")


def test_many_flagged_steps_take_their_ranks_from_one_page_of_steps(
    page: Page, seed: Seeder
) -> None:
    seed.run("flaggy", 3, **SPEC, step_timeout_s=0.2)
    partial = list(range(2, 20, 2))
    sent = [(s, r) for s in range(20) for r in range(3) if not (s in partial and r == 2)]
    seed.post(
        "flaggy",
        [{"step": s, "rank": r, "seq": 0, "values": wave(s, r)} for s, r in sent],
        [{"step": s, "rank": r, "fragments": 1} for s, r in sent],
    )
    seed.wait_for_status("flaggy", partial[-1], "partial")
    step_requests: list[str] = []
    page.on("request", lambda r: "/steps" in r.url and step_requests.append(r.url))
    page.goto("/runs/flaggy")
    expect(page.locator("#heatmap")).to_have_attribute("data-state", "ready")
    states = page.evaluate("[...Array(20).keys()].map((s) => steptally.heatmap.cellState(s, 2))")
    assert states == ["missing" if s in partial else "committed" for s in range(20)]
    assert len(step_requests) == 1 and "/v1/runs/flaggy/steps?" in step_requests[0]


def test_runs_list_pages_through_every_run_with_next_cursor(page: Page, seed: Seeder) -> None:
    for name in ("paged-a", "paged-b", "paged-c"):
        seed.run(name, 1, **SPEC)
    every = [r["name"] for r in seed.http.get("/v1/runs", params={"limit": 1000}).json()["runs"]]
    seen: list[str] = []
    page.goto("/?limit=2")
    while True:
        expect(page.locator("body")).to_have_attribute("data-state", "ready")
        rows = page.locator("#runs tbody tr").evaluate_all("(rs) => rs.map((r) => r.dataset.run)")
        assert 1 <= len(rows) <= 2
        seen += rows
        following = page.locator("#page-next")
        if following.is_hidden():
            break
        following.click()
        expect(page).to_have_url(re.compile(r"/\?limit=2&cursor="))
    assert seen == every
    assert {"paged-a", "paged-b", "paged-c"} <= set(seen)
