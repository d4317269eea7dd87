"""The README's screenshot of a TRL run (needs the trl extra).

    .venv/bin/python tests/browser/trl_screenshot.py [--out docs/screenshots] [--steps 40]

Serves a fresh SQLite database on a free port, trains ``examples/trl_grpo.py`` against
it (the tiny model on CPU, reported by the drop-in GRPOTrainer), prints the example's
table of TRL's logged values beside Steptally's, and saves the run page as seen by
headless Chromium 1440 px wide.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright
from readme_screenshots import free_port, settle

from steptally.service.embedded import EmbeddedServer
from steptally.service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
RUN = "trl-grpo-tiny"
METRICS = "kl,entropy,probs_ratio,probs_ratio_max,clip_ratio_region_mean,completion_tokens"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        database = f"sqlite:///{folder}/steptally.sqlite3"
        settings = Settings(database_url=database, port=free_port())
        with EmbeddedServer(settings) as server:
            example = ROOT / "examples" / "trl_grpo.py"
            done = subprocess.run(
                [sys.executable, str(example), "--steps", str(args.steps), "--run", RUN],
                env={**os.environ, "STEPTALLY_URL": server.url},
                capture_output=True,
                text=True,
                check=True,
            )
            print(done.stdout[done.stdout.index("\nstep") :])
            with sync_playwright() as p:
                browser = p.chromium.launch(
                    executable_path="/usr/bin/chromium", args=["--no-sandbox"]
                )
                page = browser.new_page(
                    viewport={"width": 1440, "height": 1000}, base_url=server.url
                )
                page.goto(f"/runs/{RUN}?metrics={METRICS}")
                page.wait_for_function(
                    "() => { const c = [...document.querySelectorAll('.card')];"
                    " return c.length > 0 && c.every((e) => e.dataset.state === 'ready'); }"
                )
                settle(page, "canvas[data-state=ready]")
                page.screenshot(path=str(args.out / "trl-run.png"))
                browser.close()
    print(f"saved {args.out / 'trl-run.png'}")


if __name__ == "__main__":
    main()
