"""How fast the run page opens on a long, wide run (100,000 steps × 40 metrics).

    python bench/dashboard_open.py [--steps 100000] [--anchor-steps 100] [--url URL]

Without ``--url`` it serves a fresh SQLite database on a free port. It registers a
run of 31 declared metrics and 9 derived means (40 charts), posts every step over REST
(one rank, 2,000 steps a request), then opens the run page in headless Chromium and
prints the seconds until the first chart, and the first screenful of charts and the heat
map, are drawn, and the bytes of series data fetched. The anchor, measured in the same
session and interleaved with it, is the same page over a run of ``--anchor-steps``
steps: the ratio is what a long run costs beyond the page itself.
"""

from __future__ import annotations

import argparse
import math
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from playwright.sync_api import sync_playwright

from steptally.service.embedded import EmbeddedServer
from steptally.service.settings import Settings

SUMS = [f"m{i:02d}_num" for i in range(30)]
SPEC: dict[str, Any] = {
    "metrics": {**dict.fromkeys(SUMS, "sum"), "tokens": "count"},
    "derived": {f"mean{i}": f"{SUMS[i]} / tokens" for i in range(9)},
}
CHUNK = 2000


@contextmanager
def service(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as folder:
        settings = Settings(database_url=f"sqlite:///{folder}/scale.sqlite3", port=port)
        with EmbeddedServer(settings) as server:
            yield server.url


def seed(http: httpx.Client, run: str, steps: int) -> float:
    began = time.monotonic()
    answer = http.post("/v1/runs", json={"name": run, "world_size": 1, **SPEC})
    assert answer.status_code in (200, 201), answer.text
    for first in range(0, steps, CHUNK):
        chunk = range(first, min(first + CHUNK, steps))
        fragments = [{"step": s, "rank": 0, "seq": 0, "values": values(s)} for s in chunk]
        commits = [{"step": s, "rank": 0, "fragments": 1} for s in chunk]
        answer = http.post(
            f"/v1/runs/{run}/fragments", json={"fragments": fragments, "commits": commits}
        )
        assert answer.status_code == 200, answer.text
    return time.monotonic() - began


def values(step: int) -> dict[str, float]:
    row = {
        name: math.sin(step / (50 + 7 * i)) + (5.0 if step % 9973 == i else 0.0)
        for i, name in enumerate(SUMS)
    }
    return {**row, "tokens": 1}


def open_page(url: str, run: str) -> dict[str, float]:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1440, "height": 1000}, base_url=url)
        received = {"bytes": 0}
        page.on(
            "response",
            lambda r: (
                "/series/" in r.url
                and received.__setitem__("bytes", received["bytes"] + len(r.body()))
            ),
        )
        began = time.monotonic()
        page.goto(f"/runs/{run}")
        page.wait_for_selector('.card[data-metric="mean0"][data-state="ready"]', timeout=120_000)
        first_chart = time.monotonic() - began
        page.wait_for_selector("#heatmap[data-state=ready]", timeout=120_000)
        page.wait_for_function(
            "[...steptally.visible].every((c) => c.card.dataset.state === 'ready')", timeout=120_000
        )
        screenful = time.monotonic() - began
        shown = page.evaluate("[...steptally.visible].map((c) => Number(c.card.dataset.points))")
        loaded = page.evaluate("[...steptally.charts.values()].filter((c) => !c.stale).length")
        browser.close()
    return {
        "first_chart_s": first_chart,
        "screenful_s": screenful,
        "charts_loaded": loaded,
        "points_per_chart": max(shown),
        "series_bytes": received["bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--anchor-steps", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--url", default=None)
    parser.add_argument("--run", default="scale-run")
    parser.add_argument("--no-seed", action="store_true")
    args = parser.parse_args()
    anchor = f"{args.run}-anchor"
    with service(args.url) as url, httpx.Client(base_url=url, timeout=600) as http:
        if not args.no_seed:
            for run, steps in ((args.run, args.steps), (anchor, args.anchor_steps)):
                took = seed(http, run, steps)
                print(f"seeded {run}: {steps} steps × 40 metrics in {took:.1f} s")
        # the anchor: the same page over a short run, opened in the same session, so the
        # ratio says what the run's length costs beyond the page itself
        rows: dict[str, list[dict[str, float]]] = {args.run: [], anchor: []}
        for _ in range(args.repeat):
            for run in rows:
                rows[run].append(open_page(url, run))
    print(f"{'run':<24} {'steps':>8} {'first chart':>12} {'screenful':>10} {'points':>7} {'KB':>6}")
    best = {run: min(samples, key=lambda r: r["screenful_s"]) for run, samples in rows.items()}
    for run, steps in ((args.run, args.steps), (anchor, args.anchor_steps)):
        r = best[run]
        print(
            f"{run:<24} {steps:>8} {r['first_chart_s']:>10.2f} s {r['screenful_s']:>8.2f} s "
            f"{r['points_per_chart']:>7} {r['series_bytes'] / 1024:>6.0f}"
        )
    ratio = best[args.run]["screenful_s"] / best[anchor]["screenful_s"]
    print(f"screenful, {args.steps} steps against {args.anchor_steps}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
