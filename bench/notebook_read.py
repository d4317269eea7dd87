"""Notebook read benchmark: a whole run into a DataFrame, ``steptally.client.read``
against the REST pages read by hand, in one run.

A run of ``--steps`` finalised steps (default 100,000) × ``--metrics`` series (default
40) is seeded straight into the database (``bench/series.py``'s seeding), then a real
``steptally serve`` answers, interleaved, ``--repeat`` rounds of:

* **by hand** (the anchor): ``GET /v1/runs/{run}/steps?limit=1000&cursor=…`` page after
  page with httpx, each step's ``metrics[m]["value"]`` into a list per column, then
  ``pandas.DataFrame`` — what a user writes without the client (no NaN decoding, no
  checks);
* ``Run.steps()`` (pandas) and ``Run.steps(format="polars")``.

It prints steps × metric values per second for each (the goal: ≥ 200,000 for the
client) and the client's ratio to the anchor, and checks that the client's frame holds
every step.

Usage:
    python bench/notebook_read.py --db sqlite
    python bench/notebook_read.py --db postgres --steps 20000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pandas as pd

sys.path.insert(0, str(Path(__file__).parent))
from ingest import database, server  # the ingest benchmark's helpers
from series import RUN, seed, spec

from steptally.client.read import Client


def by_hand(base: str, names: list[str]) -> pd.DataFrame:
    columns: dict[str, list[Any]] = {"step": [], **{n: [] for n in names}}
    params: dict[str, Any] = {"limit": 1000}
    with httpx.Client(base_url=base, timeout=120) as http:
        while True:
            page = http.get(f"/v1/runs/{RUN}/steps", params=params).json()
            for step in page["steps"]:
                columns["step"].append(step["step"])
                metrics = step["metrics"]
                for n in names:
                    columns[n].append(metrics[n]["value"])
            if page["next_cursor"] is None:
                return pd.DataFrame(columns)
            params["cursor"] = page["next_cursor"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--metrics", type=int, default=40)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    body = spec(args.metrics)
    names = [*body["metrics"], *body["derived"]]
    values = args.steps * len(names)
    with database(args.db) as url, server(url) as base:
        httpx.post(f"{base}/v1/runs", json=body).raise_for_status()
        started = time.perf_counter()
        seed(url, args.steps, [*range(args.metrics - 1), -1], names)
        seeded = time.perf_counter() - started
        print(f"seeded {args.steps} steps x {len(names)} series: {seeded:.1f} s")
        times: dict[str, list[float]] = {"by hand": [], "client, pandas": [], "client, polars": []}
        with Client(base, timeout=120) as client:
            run = client.run(RUN)
            reads = {
                "by hand": lambda: by_hand(base, names),
                "client, pandas": lambda: run.steps(),
                "client, polars": lambda: run.steps(format="polars"),
            }
            for round_ in range(args.repeat):
                for label, read in reads.items():
                    started = time.perf_counter()
                    frame = read()
                    times[label].append(time.perf_counter() - started)
                    assert len(frame) == args.steps, (label, len(frame))
                    print(
                        f"round {round_ + 1}/{args.repeat} {label}: {times[label][-1]:.2f} s",
                        flush=True,
                    )
    anchor = statistics.median(times["by hand"])
    print(f"\n{args.db}: {args.steps} steps x {len(names)} metrics = {values:,} values")
    print(f"{'read':<16} {'median s':>9} {'values/s':>11} {'x by hand':>10}")
    for label, samples in times.items():
        median = statistics.median(samples)
        print(f"{label:<16} {median:>9.2f} {values / median:>11,.0f} {anchor / median:>10.2f}")


if __name__ == "__main__":
    main()
