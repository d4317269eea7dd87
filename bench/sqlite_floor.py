"""What SQLite alone costs for the rows of a group of reporter bodies: the floor under
the writer's group (``bench/group_cost.py``).

On the service's own schema (migrated), without its rules, partial states or
SQLAlchemy: ``BEGIN IMMEDIATE``, one read of the group's partial rows, one multi-row
``INSERT`` each of its fragment rows (one 2 KiB row a body: 8 microbatches × 32 values,
bundled as the service stores them), commits and partial rows (800 bytes of state
each), ``COMMIT`` with ``synchronous = NORMAL``, then (``sync``) one ``fdatasync`` of
the WAL, as the service's writer does before it answers. Groups of 1 and 8 bodies, 256
ranks × 40 steps each; the CPU of this thread (``time.thread_time``: the driver's,
SQLite's and the kernel's work for it) and the wall time, a group and a body.

Usage:
    python bench/sqlite_floor.py
    python bench/sqlite_floor.py --steps 4    # quick
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import subprocess
import sys
import tempfile
import time

BODY = os.urandom(2048)  # a body's fragment row: 8 × 32 values
STATE = os.urandom(800)  # a pair's partial state
TABLES = ("fragments", "commits", "partials")


def group(db: sqlite3.Connection, wal: str, step: int, first: int, n: int, sync: bool) -> None:
    db.execute("BEGIN IMMEDIATE")
    probe = "SELECT step, rank, fragments, state FROM partials WHERE run_id = 1 AND step = ? "
    db.execute(probe + "AND rank BETWEEN ? AND ?", (step, first, first + n)).fetchall()
    ranks = range(first, first + n)
    fragments = [v for r in ranks for v in (1, step, r, 0, BODY, None, None, None)]
    db.execute(
        "INSERT INTO fragments (run_id, step, rank, seq, values_f64, present, tails, seqs) "
        "VALUES " + ",".join(["(?,?,?,?,?,?,?,?)"] * n),
        fragments,
    )
    commits = [v for r in ranks for v in (1, step, r, 8)]
    db.execute(
        "INSERT INTO commits (run_id, step, rank, fragments) VALUES " + ",".join(["(?,?,?,?)"] * n),
        commits,
    )
    partials = [v for r in ranks for v in (1, step, r, 8, STATE)]
    db.execute(
        "INSERT INTO partials (run_id, step, rank, fragments, state) VALUES "
        + ",".join(["(?,?,?,?,?)"] * n),
        partials,
    )
    db.execute("COMMIT")
    if sync:
        fd = os.open(wal, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="steps of 256 ranks, each case")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/floor.sqlite3"
        migrate = [sys.executable, "-m", "steptally.service.cli", "migrate"]
        subprocess.run([*migrate, "--database-url", f"sqlite:///{path}"], check=True)
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = NORMAL")
        db.execute("PRAGMA foreign_keys = OFF")  # no runs row: the floor of the rows alone
        print("| bodies a group | sync | CPU µs a group | wall µs a group | CPU µs a body |")
        print("|---|---|---|---|---|")
        for n, sync in ((1, False), (1, True), (8, False), (8, True)):
            groups, cpu0, wall0 = 0, time.thread_time(), time.perf_counter()
            base = 1000 * n + (500 if sync else 0)  # steps of their own
            for step in range(args.steps):
                for first in range(0, 256, n):
                    group(db, f"{path}-wal", base + step, first, n, sync)
                    groups += 1
            cpu = 1e6 * (time.thread_time() - cpu0) / groups
            wall = 1e6 * (time.perf_counter() - wall0) / groups
            print(f"| {n} | {'yes' if sync else 'no'} | {cpu:.0f} | {wall:.0f} | {cpu / n:.0f} |")
        counts = [db.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES]
        print("rows: " + ", ".join(f"{t} {n}" for t, n in zip(TABLES, counts, strict=True)))
        db.close()


if __name__ == "__main__":
    main()
