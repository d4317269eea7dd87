"""Open-step reads with the commit progress in Redis, beside the database alone.

On a fresh PostgreSQL database, one run of 4096 ranks with one open step and one of
256 ranks with 16 open steps (8 fragments × 32 metrics per rank-step, every rank but
the last committed) are ingested through the Redis-coordinated store; then the same
reads go through the SQL store alone and through the coordinated store (commits from
Redis): one step of the first run, a page of the second's steps. Prints the
statements each read sends to the database and its median time over ``--repeat``
reads, and checks that both give the same progress and fragments.

Usage:
    flock /tmp/bench.lock python bench/open_step_read.py [--admin-url URL] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
import sqlalchemy as sa
from sqlalchemy import event

from steptally.client.algebra import MetricSpec
from steptally.client.wire import decode_batch
from steptally.service.coordination.store import CoordinatedStore
from steptally.service.domain.batch import prepare
from steptally.service.domain.run import RunDraft, RunRecord
from steptally.service.settings import Settings
from steptally.service.store.factory import open_store
from steptally.service.store.migration import upgrade

ADMIN = os.environ.get(
    "STEPTALLY_TEST_PG_ADMIN", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
METRICS = {f"m{i}": "sum" for i in range(31)} | {"n": "count"}
SHAPES = ((4096, 1), (256, 16))  # ranks, open steps


def _fill(store: CoordinatedStore, run: RunRecord, steps: int) -> None:
    world = run.world_size
    for step in range(steps):
        for start in range(0, world, 64):
            ranks = range(start, min(world, start + 64))
            frags = [
                {"step": step, "rank": r, "seq": q, "values": _values(r, q)}
                for r in ranks
                for q in range(8)
            ]
            commits = [{"step": step, "rank": r, "fragments": 8} for r in ranks if r != world - 1]
            body = decode_batch({"fragments": frags, "commits": commits})
            store.ingest(run, prepare(run, body, columnar=False), 1001.0)


def _values(rank: int, seq: int) -> dict[str, float]:
    return {m: 1 if m == "n" else 0.5 + rank + seq for m in METRICS}


def _reader(source: Any, run: RunRecord, steps: int) -> Callable[[], Any]:
    """One step of a run with one open step, else a page of its steps."""
    if steps == 1:
        return functools.partial(source.get_step, run, 0)
    return functools.partial(source.list_steps, run, None, None, 100)


def _measure(engine: sa.Engine, read: Callable[[], Any], repeat: int) -> tuple[int, float]:
    """Statements of one read, and the median seconds of ``repeat`` reads."""
    sent = [0]

    def counted(*_: Any) -> None:
        sent[0] += 1

    read()  # warm
    event.listen(engine, "before_cursor_execute", counted)
    read()
    event.remove(engine, "before_cursor_execute", counted)
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        read()
        times.append(time.perf_counter() - started)
    return sent[0], statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--admin-url", default=ADMIN)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    name = f"steptally_bench_{os.getpid()}"
    admin = sa.create_engine(args.admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
    url = args.admin_url.rsplit("/", 1)[0] + "/" + name
    prefix = f"steptally-bench-{uuid.uuid4().hex}"
    try:
        upgrade(url)
        store = open_store(
            Settings(database_url=url, redis_url=args.redis_url, redis_prefix=prefix)
        )
        assert isinstance(store, CoordinatedStore)
        spec = MetricSpec.build(METRICS, {})
        for world, steps in SHAPES:
            draft = RunDraft(world, spec, 600.0)
            run, _ = store.register_run(f"w{world}", lambda _e, d=draft: d, 1000.0)
            _fill(store, run, steps)
            for label, source in (("database", store.sql), ("redis", store)):
                read = _reader(source, run, steps)
                sent, median = _measure(store.sql.engine, read, args.repeat)
                print(
                    f"{world} ranks, {steps} open step(s), {label}: "
                    f"{sent} statements, median {median * 1000:.1f} ms"
                )
            alone, coordinated = store.sql.get_step(run, 0), store.get_step(run, 0)
            assert alone is not None and coordinated is not None
            assert alone.progress == coordinated.progress
            assert list(alone.fragments) == list(coordinated.fragments)
        store.close()
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.dispose()
        client = redis.Redis.from_url(args.redis_url)
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)
        client.close()


if __name__ == "__main__":
    main()
