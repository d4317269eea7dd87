"""Ingest benchmark: values per second end to end, and finalise latency.

A step of RANKS ranks × MICROBATCHES microbatches × METRICS metrics is posted to a
real `steptally serve` subprocess in the compact form, one body per rank (its
microbatches of STEPS_PER_BATCH steps and the commits), from CONCURRENCY client
threads. Bodies are encoded before the clock starts. The last rank's commit of the
last step is held back and sent alone: its round trip is the finalise latency (the
step is combined, evaluated and stored inside that request).

Anchors, measured in the same run on the same machine:
  * http floor: the same number of requests to GET /healthz (what FastAPI, uvicorn and
    httpx cost with no work at all);
  * sql floor: a bare executemany INSERT of the same number of fragment rows with the
    same blob sizes into a scratch table (what the database costs with no logic).

Usage:
    python bench/ingest.py --db sqlite
    python bench/ingest.py --db postgres
"""

from __future__ import annotations

import argparse
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
def server(url: str) -> Iterator[str]:
    exe = [sys.executable, "-m", "steptally.service.cli"]
    subprocess.run([*exe, "migrate", "--database-url", url], check=True, capture_output=True)
    port = free_port()
    proc = subprocess.Popen(
        [*exe, "serve", "--database-url", url, "--host", "127.0.0.1", "--port", str(port)],
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


def sql_floor(url: str, rows: int, width: int) -> float:
    engine = sa.create_engine(url)
    meta = sa.MetaData()
    table = sa.Table(
        "bench_floor",
        meta,
        sa.Column("step", sa.BigInteger, primary_key=True),
        sa.Column("rank", sa.Integer, primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True),
        sa.Column("payload", sa.LargeBinary),
    )
    meta.create_all(engine)
    blob = os.urandom(8 * width)
    params = [
        {"step": i // 2048, "rank": (i // 8) % 256, "seq": i % 8, "payload": blob}
        for i in range(rows)
    ]
    t0 = time.perf_counter()
    for start in range(0, rows, 8):
        with engine.begin() as c:
            c.execute(table.insert(), params[start : start + 8])
    elapsed = time.perf_counter() - t0
    meta.drop_all(engine)
    engine.dispose()
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    p.add_argument("--ranks", type=int, default=256)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--metrics", type=int, default=32)
    p.add_argument("--steps", type=int, default=4, help="steps measured")
    p.add_argument("--steps-per-batch", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args()
    names = list(spec(args.metrics)["metrics"])
    values = args.ranks * args.microbatches * args.metrics * args.steps
    with database(args.db) as url, server(url) as base, httpx.Client(timeout=120) as client:
        run = {
            "name": "bench",
            "world_size": args.ranks,
            "step_timeout_s": 3600,
            **spec(args.metrics),
        }
        client.post(f"{base}/v1/runs", json=run).raise_for_status()
        frag_url = f"{base}/v1/runs/bench/fragments"
        warm = bodies(args, names, range(1000, 1001))
        post_all(client, frag_url, warm, args.concurrency)
        print(
            f"encoding {args.steps} steps of {args.ranks}×{args.microbatches}×{args.metrics}",
            file=sys.stderr,
        )
        payloads: list[bytes] = []
        for first in range(0, args.steps, args.steps_per_batch):
            span = range(first, min(first + args.steps_per_batch, args.steps))
            payloads.extend(bodies(args, names, span))
        print(f"posting {len(payloads)} bodies", file=sys.stderr)
        elapsed = post_all(client, frag_url, payloads, args.concurrency)
        # finalise latency: everything of one step but the last rank's commit
        last = bodies(args, names, range(2000, 2001))
        held = orjson.loads(last[-1])
        commit = held.pop("commits")
        post_all(client, frag_url, [*last[:-1], orjson.dumps(held)], args.concurrency)
        t0 = time.perf_counter()
        client.post(frag_url, json={"commits": commit}).raise_for_status()
        finalise = time.perf_counter() - t0
        status = client.get(f"{base}/v1/runs/bench/steps/2000").json()["status"]
        assert status == "complete", status
        http = http_floor(client, base, len(payloads), args.concurrency)
    floor_rows = len(payloads) * args.microbatches * args.steps_per_batch
    with database(args.db) as url:
        sql = sql_floor(url, floor_rows, args.metrics)
    rate = values / elapsed
    print("\n| db | values | seconds | values/s | vs http floor | vs sql floor | finalise ms |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {args.db} | {values} | {elapsed:.2f} | {rate:,.0f} | {elapsed / http:.1f}× "
        f"| {elapsed / sql:.1f}× | {finalise * 1000:.0f} |"
    )
    print(
        f"\nhttp floor: {len(payloads)} GET /healthz in {http:.2f}s; "
        f"sql floor: {floor_rows} rows in {sql:.2f}s"
    )


if __name__ == "__main__":
    main()
