"""Series benchmark: "open a run" on the dashboard, on a run of STEPS × METRICS values.

A run of ``--steps`` finalised steps (default 100,000) with ``--metrics`` series
(default 40: 39 declared metrics and one derived value) is seeded straight into the
database — steps rows with a stored result of the run's size, one ``step_values`` row
per step and metric, 0.2 % partial steps, 0.1 % revised ones, a few NaN and infinite
values — then a real ``steptally serve`` subprocess answers:

* open a run: the ``--metrics`` series requests with ``points=1000`` one after
  another (the dashboard's worst case; a browser sends up to six at once), timed
  whole, best of ``--repeat``;
* the same with six requests in flight;
* p50/p99 of single series requests (points=1000), and of a full series of 10,000
  steps (no downsampling).

Usage:
    python bench/series.py --db sqlite
    python bench/series.py --db postgres
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).parent))
from ingest import database, server  # the ingest benchmark's helpers

RUN = "series-bench"
STEP_COLUMNS = (
    "run_id, step, status, revision, committed_ranks, expected, received, missing_ranks, "
    "first_seen_at, deadline, finalised_at, result"
)


def spec(metrics: int) -> dict[str, Any]:
    names = {f"m{i:02d}": ("count" if i == 1 else "sum") for i in range(metrics - 1)}
    return {"name": RUN, "world_size": 8, "metrics": names, "derived": {"mean": "m00 / m01"}}


def value(rng: random.Random, col: int, step: int) -> tuple[float | None, int]:
    roll = rng.random()
    if roll < 1e-4:
        return None, 1  # NaN
    if roll < 2e-4:
        return math.inf, 0
    return math.sin(step / (50 + col)) + rng.gauss(0, 0.1), 0


def seed(url: str, steps: int, columns: list[int], names: list[str]) -> None:
    """Steps and step_values of the run, by bulk SQL (COPY on PostgreSQL)."""
    rng = random.Random(7)
    metric = {"value": 1.0, "reason": None, "kind": "sum", "values": 8, "non_finite": 0}
    result = orjson.dumps(
        {
            "status": "complete",
            "metrics": {n: metric for n in names},
            "ranks_committed": list(range(8)),
            "ranks_missing": [],
            "missing_fragments": {},
            "received": 64,
            "expected": 64,
        }
    ).decode()
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        run_id = conn.execute(sa.text("SELECT id FROM runs WHERE name = :n"), {"n": RUN}).scalar()
        step_rows, value_rows = [], []
        for s in range(steps):
            roll = rng.random()
            status, revision = ("partial", 1) if roll < 0.002 else ("complete", 1)
            if 0.002 <= roll < 0.003:
                revision = 2
            times = (float(s), s + 60.0, s + 1.0)
            step_rows.append((run_id, s, status, revision, 8, 64, 64, 0, *times, result))
            value_rows += [(run_id, c, s, *value(rng, c, s)) for c in columns]
        _bulk(conn, "steps", STEP_COLUMNS, step_rows)
        _bulk(conn, "step_values", "run_id, col, step, value, state", value_rows)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        # what autovacuum does soon after the inserts (it also marks PostgreSQL's pages
        # all-visible, which index-only scans need)
        conn.exec_driver_sql("VACUUM ANALYZE" if conn.dialect.name == "postgresql" else "ANALYZE")
    engine.dispose()


def _bulk(conn: sa.Connection, table: str, columns: str, rows: list[tuple[Any, ...]]) -> None:
    if conn.dialect.name == "postgresql":
        driver = conn.connection.driver_connection
        with driver.cursor().copy(f"COPY {table} ({columns}) FROM STDIN") as copy:  # type: ignore[union-attr]
            for row in rows:
                copy.write_row(row)
        return
    marks = ", ".join("?" * len(columns.split(",")))
    conn.exec_driver_sql(f"INSERT INTO {table} ({columns}) VALUES ({marks})", rows)


def timed(client: httpx.Client, url: str, params: dict[str, Any]) -> float:
    t = time.perf_counter()
    response = client.get(url, params=params)
    elapsed = time.perf_counter() - t
    assert response.status_code == 200, response.text
    return elapsed


def open_run(base: str, names: list[str], workers: int) -> float:
    limits = httpx.Limits(max_connections=workers)
    with httpx.Client(limits=limits, timeout=60) as client:
        urls = [f"{base}/v1/runs/{RUN}/series/{n}" for n in names]
        t = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda u: timed(client, u, {"points": 1000}), urls))
        return time.perf_counter() - t


def percentiles(samples: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(samples, n=100, method="inclusive")
    return q[49] * 1e3, q[98] * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--metrics", type=int, default=40)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--samples", type=int, default=200)
    args = p.parse_args()
    body = spec(args.metrics)
    names = [*body["metrics"], *body["derived"]]
    with database(args.db) as url, server(url) as base:
        httpx.post(f"{base}/v1/runs", json=body).raise_for_status()
        columns = [*range(args.metrics - 1), -1]
        t = time.perf_counter()
        seed(url, args.steps, columns, names)
        print(f"seeded {args.steps} steps x {args.metrics} series: {time.perf_counter() - t:.1f} s")
        rows = []
        for workers in (1, 6):
            label = f"open a run: {args.metrics} requests, {workers} at a time"
            rows.append((label, min(open_run(base, names, workers) for _ in range(args.repeat))))
        with httpx.Client(timeout=60) as client:
            url_of = f"{base}/v1/runs/{RUN}/series/" + "{}"
            one = [
                timed(client, url_of.format(names[i % len(names)]), {"points": 1000})
                for i in range(args.samples)
            ]
            full = [
                timed(client, url_of.format(names[i % len(names)]), {"end": 9_999})
                for i in range(args.samples // 4)
            ]
            answer = client.get(url_of.format(names[0]), params={"points": 1000}).json()
    kept = len(answer["steps"])
    print(f"\n{args.db}: {args.steps} steps x {args.metrics} series, points=1000 keeps {kept}")
    print(f"{'measure':<46} {'value':>12}")
    for label, seconds in rows:
        print(f"{label:<46} {seconds:>10.3f} s")
    for label, samples in (("series points=1000", one), ("series 10,000 steps, full", full)):
        p50, p99 = percentiles(samples)
        print(f"{label + ' p50 / p99':<46} {p50:>5.1f} / {p99:.1f} ms")


if __name__ == "__main__":
    main()
