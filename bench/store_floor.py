"""What the database alone costs for the rows of a group of reporter bodies: the floor
under the writer's group (``bench/group_cost.py``), on SQLite and on PostgreSQL.

On the service's own schema (migrated), without its rules, partial states, step rows or
SQLAlchemy, through the driver alone: one transaction a group, holding one read of the
group's partial rows and one multi-row ``INSERT`` each of its fragment rows (one 2 KiB
row a body: 8 microbatches × 32 values, bundled as the service stores them), commits
and partial rows (800 bytes of state each). Foreign keys are off (no ``runs`` row: the
floor of these rows alone).

- SQLite: ``BEGIN IMMEDIATE`` … ``COMMIT`` with ``synchronous = NORMAL``, then (``sync``)
  one ``fdatasync`` of the WAL, as the service's writer does before it answers.
- PostgreSQL: the group in one round trip (psycopg's pipeline, as the service's writer
  sends a fresh group), its ``COMMIT`` durable (``sync``), or with
  ``synchronous_commit = off`` (no sync: measured only, an answer the service never
  gives).

Groups of 1 and 8 bodies, 256 ranks × ``--steps`` steps each; the CPU of this thread
(``time.thread_time``: the driver's, SQLite's and the kernel's work for it), of the
PostgreSQL backend (``/proc``), and the wall time, a group and a body.

Usage:
    python bench/store_floor.py                  # SQLite
    python bench/store_floor.py --db postgres
    python bench/store_floor.py --steps 4        # quick
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).parent))
import procstat
from ingest import database  # the ingest benchmark's: a fresh database

BODY = os.urandom(2048)  # a body's fragment row: 8 × 32 values
STATE = os.urandom(800)  # a pair's partial state
TABLES = ("fragments", "commits", "partials")
CASES = ((1, False), (1, True), (8, False), (8, True))
#: (read, fragments, commits, partials) with the placeholders of a group of n
Statements = Callable[[int], tuple[str, str, str, str]]


def statements(mark: str) -> Statements:
    def of(n: int) -> tuple[str, str, str, str]:
        def rows(width: int) -> str:
            return ",".join(["(" + ",".join([mark] * width) + ")"] * n)

        return (
            "SELECT step, rank, fragments, state FROM partials WHERE run_id = 1 AND step = "
            f"{mark} AND rank BETWEEN {mark} AND {mark}",
            "INSERT INTO fragments (run_id, step, rank, seq, values_f64, present, tails, seqs) "
            "VALUES " + rows(8),
            "INSERT INTO commits (run_id, step, rank, fragments) VALUES " + rows(4),
            "INSERT INTO partials (run_id, step, rank, fragments, state) VALUES " + rows(5),
        )

    return of


def parameters(step: int, first: int, n: int) -> tuple[tuple[Any, ...], ...]:
    ranks = range(first, first + n)
    return (
        (step, first, first + n),
        tuple(v for r in ranks for v in (1, step, r, 0, BODY, None, None, None)),
        tuple(v for r in ranks for v in (1, step, r, 8)),
        tuple(v for r in ranks for v in (1, step, r, 8, STATE)),
    )


class Sqlite:
    backend = None

    def __init__(self, path: str) -> None:
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.execute("PRAGMA synchronous = NORMAL")
        self.db.execute("PRAGMA foreign_keys = OFF")
        self.wal = f"{path}-wal"
        self.sql = statements("?")

    def group(self, step: int, first: int, n: int, sync: bool) -> None:
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        for sql, params in zip(self.sql(n), parameters(step, first, n), strict=True):
            db.execute(sql, params).fetchall()
        db.execute("COMMIT")
        if sync:
            fd = os.open(self.wal, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)

    def count(self, table: str) -> int:
        return int(self.db.execute(f"SELECT count(*) FROM {table}").fetchone()[0])

    def close(self) -> None:
        self.db.close()


class Postgres:
    def __init__(self, url: str) -> None:
        self.db = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"))
        self.db.execute("SET session_replication_role = replica")  # no foreign keys
        self.db.commit()
        self.backend: int | None = self.db.info.backend_pid
        self.sql = statements("%s")
        self._sync: bool | None = None

    def group(self, step: int, first: int, n: int, sync: bool) -> None:
        db = self.db
        if sync is not self._sync:
            db.execute(f"SET synchronous_commit = {'on' if sync else 'off'}")
            db.commit()
            self._sync = sync
        with db.pipeline():
            cursors = [
                db.execute(sql, params)
                for sql, params in zip(self.sql(n), parameters(step, first, n), strict=True)
            ]
            db.commit()
        cursors[0].fetchall()

    def count(self, table: str) -> int:
        row = self.db.execute(f"SELECT count(*) FROM {table}").fetchone()
        self.db.commit()
        assert row is not None
        return int(row[0])

    def close(self) -> None:
        self.db.close()


@contextmanager
def store(kind: str) -> Iterator[Sqlite | Postgres]:
    with database(kind) as url:
        migrate = [sys.executable, "-m", "steptally.service.cli", "migrate"]
        subprocess.run([*migrate, "--database-url", url], check=True, capture_output=True)
        db = Sqlite(url.removeprefix("sqlite:///")) if kind == "sqlite" else Postgres(url)
        try:
            yield db
        finally:
            db.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    p.add_argument("--steps", type=int, default=40, help="steps of 256 ranks, each case")
    args = p.parse_args(argv)
    with store(args.db) as db:
        print(
            "| bodies a group | sync | CPU µs a group | database CPU µs a group | wall µs a group "
            "| CPU µs a body |"
        )
        print("|---|---|---|---|---|---|")
        for n, sync in CASES:
            groups = 0
            base = 1000 * n + (500 if sync else 0)  # steps of their own
            db0 = procstat.cpu_s(db.backend) if db.backend else 0.0
            cpu0, wall0 = time.thread_time(), time.perf_counter()
            for step in range(args.steps):
                for first in range(0, 256, n):
                    db.group(base + step, first, n, sync)
                    groups += 1
            cpu = 1e6 * (time.thread_time() - cpu0) / groups
            wall = 1e6 * (time.perf_counter() - wall0) / groups
            backend = 1e6 * (procstat.cpu_s(db.backend) - db0) / groups if db.backend else 0.0
            print(
                f"| {n} | {'yes' if sync else 'no'} | {cpu:.0f} | {backend:.0f} | {wall:.0f} "
                f"| {(cpu + backend) / n:.0f} |"
            )
        counts = [db.count(t) for t in TABLES]
        print("rows: " + ", ".join(f"{t} {n}" for t, n in zip(TABLES, counts, strict=True)))


if __name__ == "__main__":
    main()
