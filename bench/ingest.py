"""Ingest benchmark: values per second end to end, and finalise latency.

A step of RANKS ranks × MICROBATCHES microbatches × METRICS metrics is posted to a
real `steptally serve` subprocess in the compact form, one body per rank (its
microbatches of STEPS_PER_BATCH steps and the commits), from CONCURRENCY client
threads. Bodies are encoded before the clock starts; each row is the best of REPEAT
posts of STEPS fresh steps. Finalise latency: everything of a step but the last rank's
commit is posted, then that commit alone is timed (the step is combined, evaluated and
stored inside that request); the median of three.

Anchors, measured in the same run on the same machine, as ratios (× floor = ingest
time over floor time; 1.00 would be ingest at no cost beyond the floor):
  * http floor: as many GET /healthz as there were bodies, at the same concurrency
    (what FastAPI, uvicorn and httpx cost with no work at all);
  * sql floor: as many transactions as there were bodies, each a bare executemany
    INSERT of one body's fragment rows (same blob size) into a scratch table, at the
    same concurrency, on an engine configured like the service's (SQLite: WAL,
    synchronous=FULL) — what a durable commit per body costs with no logic.

With ``--alerts N`` the run has N alert rules (:func:`alert_rules`), checked at every
finalisation: what checking them adds to ingest and to the finalising request.

Usage:
    python bench/ingest.py --db sqlite                       # steps/body 1 and 8
    python bench/ingest.py --db postgres --alerts 16         # with 16 alert rules
    python bench/ingest.py --db postgres --steps-per-batch 1 2 4 8
    python bench/ingest.py --db postgres --workers 2         # steptally serve --workers 2
"""

from __future__ import annotations

import argparse
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import orjson
import sqlalchemy as sa

from steptally.client.wire import Commit, FragmentBatch, encode_columnar
from steptally.service.store.engine import make_engine, transaction

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def database(kind: str) -> Iterator[str]:
    if kind == "sqlite":
        with tempfile.TemporaryDirectory() as d:
            yield f"sqlite:///{d}/bench.sqlite3"
        return
    name = f"steptally_bench_{os.getpid()}"
    admin = sa.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
        c.exec_driver_sql(f"CREATE DATABASE {name}")
    try:
        yield PG_ADMIN.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as c:
            c.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.dispose()


@contextmanager
def server(url: str, workers: int = 1) -> Iterator[str]:
    exe = [sys.executable, "-m", "steptally.service.cli"]
    subprocess.run([*exe, "migrate", "--database-url", url], check=True, capture_output=True)
    port = free_port()
    proc = subprocess.Popen(
        [*exe, "serve", "--database-url", url, "--host", "127.0.0.1", "--port", str(port)]
        + (["--workers", str(workers)] if workers > 1 else []),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                if httpx.get(f"{base}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


def spec(metrics: int) -> dict[str, Any]:
    kinds = ["sum"] * (metrics - 4) + ["count", "count", "min", "max"]
    names = {f"m{i:02d}": k for i, k in enumerate(kinds)}
    return {"metrics": names, "derived": {"mean0": "m00 / m28"}}


def alert_rules(n: int) -> list[dict[str, Any]]:
    """``n`` alert rules of the run: half thresholds, half changes against the mean of the
    last 10 steps (each reads the stored values when it is checked), on distinct metrics;
    the last one breaks at every step (a ``count`` above 0), so each finalisation also
    writes a breach."""
    rules: list[dict[str, Any]] = []
    for i in range(n - 1):
        metric = f"m{i % 28:02d}"
        if i % 2:
            rules.append({"name": f"c{i}", "metric": metric, "change_above": 1e300, "window": 10})
        else:
            rules.append({"name": f"t{i}", "metric": metric, "above": 1e300})
    if n:
        rules.append({"name": "always", "metric": "m28", "above": 0})
    return rules


def bodies(args: argparse.Namespace, names: list[str], steps: range) -> list[bytes]:
    rnd = random.Random(7)
    out = []
    for rank in range(args.ranks):
        batch = FragmentBatch(metrics=names)
        for step in steps:
            for seq in range(args.microbatches):
                batch.steps.append(step)
                batch.ranks.append(rank)
                batch.seqs.append(seq)
                row = [rnd.gauss(0, 1) for _ in names]
                row[-4] = float(rnd.randrange(1, 4096))
                row[-3] = float(rnd.randrange(1, 64))
                batch.values.extend(array("d", row))
            batch.commits.append(Commit(step, rank, args.microbatches))
        out.append(orjson.dumps(encode_columnar(batch)))
    return out


def post_all(client: httpx.Client, url: str, payloads: list[bytes], workers: int) -> float:
    headers = {"content-type": "application/json"}

    def send(body: bytes) -> None:
        r = client.post(url, content=body, headers=headers)
        r.raise_for_status()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(send, payloads))
    return time.perf_counter() - t0


def http_floor(client: httpx.Client, base: str, n: int, workers: int) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda _: client.get(f"{base}/healthz").raise_for_status(), range(n)))
    return time.perf_counter() - t0


def sql_floor(url: str, transactions: int, rows: int, width: int, workers: int) -> float:
    """``transactions`` bare inserts of ``rows`` fragment-sized rows each, from ``workers``
    threads, on an engine configured like the service's (SQLite: WAL, synchronous=FULL)."""
    engine = make_engine(url)
    meta = sa.MetaData()
    table = sa.Table(
        "bench_floor",
        meta,
        sa.Column("txn", sa.BigInteger, primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True),
        sa.Column("payload", sa.LargeBinary),
    )
    meta.create_all(engine)
    blob = os.urandom(8 * width)

    def insert(txn: int) -> None:
        with transaction(engine, write=True) as c:
            c.execute(
                table.insert(), [{"txn": txn, "seq": i, "payload": blob} for i in range(rows)]
            )

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(insert, range(transactions)))
    elapsed = time.perf_counter() - t0
    meta.drop_all(engine)
    engine.dispose()
    return elapsed


def finalise_ms(client: httpx.Client, base: str, args: argparse.Namespace, step: int) -> float:
    """Everything of ``step`` but the last rank's commit, then that commit alone, timed."""
    names = list(spec(args.metrics)["metrics"])
    frag_url = f"{base}/v1/runs/bench/fragments"
    last = bodies(args, names, range(step, step + 1))
    held = orjson.loads(last[-1])
    commit = held.pop("commits")
    post_all(client, frag_url, [*last[:-1], orjson.dumps(held)], args.concurrency)
    t0 = time.perf_counter()
    client.post(frag_url, json={"commits": commit}).raise_for_status()
    elapsed = time.perf_counter() - t0
    status = client.get(f"{base}/v1/runs/bench/steps/{step}").json()["status"]
    assert status == "complete", status
    return elapsed * 1000


def measure(
    client: httpx.Client, base: str, args: argparse.Namespace, per_body: int, first: int
) -> tuple[float, int]:
    """Best of ``args.repeat`` timed posts of ``args.steps`` fresh steps; returns the
    seconds and the number of bodies of one post."""
    names = list(spec(args.metrics)["metrics"])
    best, count = math.inf, 0
    for r in range(args.repeat):
        base_step = first + r * args.steps
        payloads: list[bytes] = []
        for s in range(base_step, base_step + args.steps, per_body):
            span = range(s, min(s + per_body, base_step + args.steps))
            payloads.extend(bodies(args, names, span))
        elapsed = post_all(client, f"{base}/v1/runs/bench/fragments", payloads, args.concurrency)
        best, count = min(best, elapsed), len(payloads)
    return best, count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    p.add_argument("--ranks", type=int, default=256)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--metrics", type=int, default=32)
    p.add_argument("--steps", type=int, default=8, help="steps per timed post")
    p.add_argument(
        "--steps-per-batch", type=int, nargs="+", default=[1, 8], help="steps in one body"
    )
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3, help="timed posts per row; the best counts")
    p.add_argument("--workers", type=int, default=1, help="steptally serve --workers")
    p.add_argument("--alerts", type=int, default=0, help="alert rules of the run (see alert_rules)")
    args = p.parse_args()
    rows = []
    with (
        database(args.db) as url,
        server(url, args.workers) as base,
        httpx.Client(timeout=120) as client,
    ):
        run = {
            "name": "bench",
            "world_size": args.ranks,
            "step_timeout_s": 3600,
            **spec(args.metrics),
            "alerts": alert_rules(args.alerts),
        }
        client.post(f"{base}/v1/runs", json=run).raise_for_status()
        names = list(run["metrics"])
        warm = bodies(args, names, range(10**6, 10**6 + 2))
        post_all(client, f"{base}/v1/runs/bench/fragments", warm, args.concurrency)
        first = 0
        for per_body in args.steps_per_batch:
            elapsed, count = measure(client, base, args, per_body, first)
            first += args.repeat * args.steps
            fin = sorted(finalise_ms(client, base, args, 2 * 10**6 + first + i) for i in range(3))
            http = min(http_floor(client, base, count, args.concurrency) for _ in range(2))
            rows.append((per_body, count, elapsed, fin[1], http))
    values = args.ranks * args.microbatches * args.metrics * args.steps
    print(
        f"\n{args.db}, {args.ranks} ranks × {args.microbatches} microbatches × {args.metrics} "
        f"metrics, {values} values per post, concurrency {args.concurrency}, "
        f"workers {args.workers}, {args.alerts} alert rules, best of {args.repeat}\n"
    )
    print("| db | steps/body | bodies | values/s | × http floor | × sql floor | finalise ms |")
    print("|---|---|---|---|---|---|---|")
    for per_body, count, elapsed, fin, http in rows:
        with database(args.db) as url:
            frags = args.microbatches * per_body
            sql = min(
                sql_floor(url, count, frags, args.metrics, args.concurrency) for _ in range(2)
            )
        print(
            f"| {args.db} | {per_body} | {count} | {values / elapsed:,.0f} | {elapsed / http:.2f} "
            f"| {elapsed / sql:.2f} | {fin:.0f} |",
            flush=True,
        )
        print(
            f"  (http floor {http:.2f}s = {values / http:,.0f} values/s; sql floor {sql:.2f}s "
            f"= {values / sql:,.0f} values/s; ingest {elapsed:.2f}s)",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
