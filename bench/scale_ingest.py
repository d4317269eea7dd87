"""Ingest alone, for one configuration: what ``bench/scale.py`` times, without its
anchors, so that two settings can be compared in quick interleaved pairs.

One ``steptally serve`` (``--workers``, ``--cpus``) on a fresh database takes
``--steps`` steps of every one of ``--ranks`` ranks from ``--clients`` client processes
(reporter-shaped bodies, as in ``scale.py``). Printed, once every step is complete:
rank-steps/s, and over the same window the server's CPU a body split into its
processes' main threads (the event loops) and their other threads (the writers and the
rest), user and system, and its read and write system calls a body
(``/proc/<pid>/io``). The server's environment is this one's
(``STEPTALLY_INGEST_*`` included), so a setting is compared by running this twice.

Usage:
    python bench/scale_ingest.py --db sqlite --cpus 1
    STEPTALLY_INGEST_WRITERS=2 python bench/scale_ingest.py --db postgres --cpus 1
    python bench/scale_ingest.py --db sqlite --cpus 0,1 --workers 2 --ranks 4096 --steps 4
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import procstat
from ingest import database  # the ingest benchmark's
from loadgen import blast
from scale import RUN, Backends, Window, ingest_jobs, prepared, register_runs, replicas


def threads(pid: int) -> Counter[str]:
    """CPU seconds of the process family of ``pid``: its main threads' and the others',
    user and system apart; and their read and write system calls."""
    out: Counter[str] = Counter()
    for p in procstat.family(pid):
        for tid in map(int, os.listdir(f"/proc/{p}/task")):
            user, system = procstat.thread_cpu_s(p, tid)  # 0.0 for one that ended meanwhile
            kind = "loop" if tid == p else "other"
            out[f"{kind}_user"] += user
            out[f"{kind}_system"] += system
        io = dict(line.split(": ") for line in Path(f"/proc/{p}/io").read_text().splitlines())
        out["reads"] += int(io["syscr"])
        out["writes"] += int(io["syscw"])
    return out


def _complete(base: str, steps: int) -> int:
    """How many steps of the run are complete (waiting up to 10 s for all ``steps``)."""
    deadline = time.monotonic() + 10
    while True:
        complete = int(httpx.get(f"{base}/v1/runs/{RUN}").json()["steps"]["complete"])
        if complete >= steps or time.monotonic() > deadline:
            return complete
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    p.add_argument("--cpus", default=None, help="steptally serve --cpus (unset: unpinned)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--ranks", type=int, default=256)
    p.add_argument("--steps", type=int, default=96)
    p.add_argument("--clients", type=int, default=8)
    args = p.parse_args(argv)
    bodies = prepared(args.ranks, args.steps)
    with (
        tempfile.TemporaryDirectory() as logs,
        database(args.db) as url,
        replicas(url, 1, None, Path(logs), args.workers, args.cpus) as servers,
    ):
        server = servers[0]
        register_runs(server.base, args.ranks, args.clients)
        jobs = ingest_jobs(bodies, [server.port], args.clients, warm=True)
        backends = Backends(url)
        window = Window([server.proc.pid], backends)
        before: list[Counter[str]] = []

        def start() -> None:
            before.append(threads(server.proc.pid))
            window.start()

        try:
            result = blast(jobs, on_start=start)
            window.stop()
            after = threads(server.proc.pid)
            complete = _complete(server.base, args.steps)
        finally:
            backends.close()
    if result.errors:
        raise SystemExit(f"{len(result.errors)} errors, first: {result.errors[0]}")
    if complete != args.steps:
        raise SystemExit(f"{complete} of {args.steps} steps complete after the last answer")
    done = result.done
    per = {k: (after[k] - before[0][k]) / done for k in after}
    print(
        f"{args.db} cpus={args.cpus or '-'} workers={args.workers} ranks={args.ranks}: "
        f"{done / result.elapsed_s:.0f} rank-steps/s, server CPU {1e6 * window.server_s / done:.0f}"
        f" µs a body (event loops {1e6 * (per['loop_user'] + per['loop_system']):.0f}, other "
        f"threads {1e6 * (per['other_user'] + per['other_system']):.0f}; system "
        f"{1e6 * (per['loop_system'] + per['other_system']):.0f}), database CPU "
        f"{1e6 * window.db_s / done:.0f} µs a body, reads {per['reads']:.1f} and writes "
        f"{per['writes']:.1f} a body"
    )


if __name__ == "__main__":
    main()
