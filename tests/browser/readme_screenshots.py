"""The README's dashboard screenshots, made from the demo run (needs the torch extra).

    .venv/bin/python tests/browser/readme_screenshots.py [--out docs/screenshots]

Serves a fresh SQLite database on a free port, plays two demo runs into it with
``steptally demo`` and a small run with two partial steps over REST, and saves the
runs list and the run page (the detail of a step that broke an alert rule open) as PNGs, seen by
headless Chromium 1440 px wide.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from playwright.sync_api import Page, sync_playwright

from steptally.service.embedded import EmbeddedServer
from steptally.service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
RUNS = {"demo-grpo": 8, "demo-grpo-6-ranks": 6}  # run: ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def play(url: str, run: str, ranks: int, steps: int) -> None:
    command = [sys.executable, "-m", "steptally.service.cli", "demo", "--url", url]
    command += ["--run", run, "--ranks", str(ranks), "--steps", str(steps), "--interval", "0.05"]
    subprocess.run(command, check=True, capture_output=True, timeout=600)


def play_rest(url: str, run: str, steps: int, missing: set[int]) -> None:
    """A 4-rank run over plain REST whose rank 3 never commits the ``missing`` steps."""
    spec = {"ratio_num": "sum", "actor_tokens": "count", "ratio_max": "max"}
    body = {"name": run, "world_size": 4, "metrics": spec, "step_timeout_s": 0.5}
    body["derived"] = {"probs_ratio": "ratio_num / actor_tokens"}
    with httpx.Client(base_url=url) as http:
        http.post("/v1/runs", json=body).raise_for_status()
        sent = [(s, r) for s in range(steps) for r in range(4) if not (s in missing and r == 3)]
        values = [
            {"ratio_num": 1 + s / 100 + r / 7, "actor_tokens": 1, "ratio_max": 1.2 + r}
            for s, r in sent
        ]
        fragments = [
            {"step": s, "rank": r, "seq": 0, "values": v}
            for (s, r), v in zip(sent, values, strict=True)
        ]
        commits = [{"step": s, "rank": r, "fragments": 1} for s, r in sent]
        answer = http.post(
            f"/v1/runs/{run}/fragments", json={"fragments": fragments, "commits": commits}
        )
        answer.raise_for_status()


def revised_step(url: str, run: str) -> int:
    """A step re-finalised after a late rank, to show in the detail panel."""
    steps = httpx.get(f"{url}/v1/runs/{run}/steps", params={"limit": 1000}).json()["steps"]
    return next((s["step"] for s in steps if s["revision"] > 1), 0)


def breached_step(url: str, run: str) -> int | None:
    """A step that broke one of the run's alert rules (the demo's filtering burst)."""
    found = httpx.get(f"{url}/v1/runs/{run}/breaches").json()["breaches"]
    return found[0]["step"] if found else None


def settle(page: Page, selector: str) -> None:
    page.wait_for_selector(selector)
    page.wait_for_timeout(500)


def shoot(url: str, out: Path) -> None:
    primary, overlay = RUNS
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1440, "height": 1000}, base_url=url)
        page.goto("/")
        settle(page, "body[data-state=ready]")
        page.set_viewport_size({"width": 1440, "height": 300})
        page.screenshot(path=str(out / "runs-list.png"))
        page.set_viewport_size({"width": 1440, "height": 1000})
        step = breached_step(url, primary) or revised_step(url, primary)
        page.goto(f"/runs/{primary}?overlay={overlay}&step={step}")
        settle(page, "#detail[data-state=ready]")
        page.screenshot(path=str(out / "run-page.png"))
        browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        database = f"sqlite:///{folder}/steptally.sqlite3"
        settings = Settings(database_url=database, port=free_port(), sweep_interval_s=0.2)
        with EmbeddedServer(settings) as server:
            for run, ranks in RUNS.items():
                play(server.url, run, ranks, args.steps)
            play_rest(server.url, "eval-sweep-4-ranks", 40, missing={17, 31})
            time.sleep(1.5)  # past its step timeout: the sweeper finalises both partial
            shoot(server.url, args.out)
    print(f"saved {args.out / 'runs-list.png'} and {args.out / 'run-page.png'}")


if __name__ == "__main__":
    main()
