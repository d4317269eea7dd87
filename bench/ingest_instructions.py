"""The instructions the ingest's own work costs a body, counted by callgrind: the same
every time for the same code, where its time on these machines drifts by ±15 % from one
minute to the next (bench/README.md, Scale), so that a change of a few per cent to the
hot path shows in one run.

In one process, on a fresh database: reporter-shaped bodies (``bench/scale.py``'s, 256
ranks) decoded and prepared as the service prepares them (``Ingest.prepare``), then
stored in groups of 8 as a writer thread stores them (``SqlStore``'s group function,
its sync included), on this thread. No HTTP: what the event loop spends on requests
and answers is not in it. Run under ``valgrind --tool=callgrind`` twice, with ``n``
and ``2n`` steps of every rank, the bodies of ``2n`` steps made in both; the difference
is what ``256 n`` bodies cost once the process is warm (the import, the making of the
bodies and the first steps cancel out). Printed: user-space
instructions a body (the database's kernel work, and PostgreSQL's backend, are not
counted).

Usage:
    python bench/ingest_instructions.py                  # SQLite, n = 2
    python bench/ingest_instructions.py --db postgres
    python bench/ingest_instructions.py --before fd73896   # that revision, then this tree
    python bench/ingest_instructions.py --inner --steps 4   # one run, no valgrind
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from scale_rounds import ROOT, checkout

HERE = Path(__file__).resolve().parent
RANKS = 256
GROUP = 8


def inner(db: str, steps: int, made: int) -> None:
    """The measured work, in this process: ``steps`` steps of every rank (of ``made``
    made first, so that both runs make as many bodies)."""
    sys.path.insert(0, str(HERE))
    from ingest import database, spec
    from prometheus_client import CollectorRegistry
    from scale import METRICS, RUN, prepared

    from steptally.client.algebra import MetricSpec
    from steptally.service.domain.run import RunDraft
    from steptally.service.metrics.instruments import Telemetry
    from steptally.service.store.group_commit import Pending, batch_bytes
    from steptally.service.store.migration import upgrade
    from steptally.service.store.sql import SqlStore
    from steptally.service.usecase.ingest import Ingest
    from steptally.service.usecase.registration import RunDirectory

    bodies = prepared(RANKS, made)[:steps]
    with database(db) as url:
        upgrade(url)
        store = SqlStore.from_url(url)
        try:
            run_spec = spec(METRICS)
            draft = RunDraft(
                RANKS, MetricSpec.build(run_spec["metrics"], run_spec["derived"]), 3600
            )
            store.register_run(RUN, lambda _: draft, 0.0)
            telemetry = Telemetry(CollectorRegistry())
            ingest = Ingest(store, RunDirectory(store), telemetry, lambda: 1.0)
            for step in bodies:
                for at in range(0, RANKS, GROUP):
                    group = []
                    for body in step[at : at + GROUP]:
                        p = ingest.prepare(RUN, body)
                        group.append(Pending(p.run, p.batch, 1.0, batch_bytes(p.batch)))
                    store._ingest_group(group)
                    for p in group:
                        assert p.error is None and p.outcome is not None, p.error
            summary = store.run_summary(RUN)
            assert summary is not None
        finally:
            store.close()


def counted(db: str, steps: int, made: int, pythonpath: Path | None = None) -> int:
    """User-space instructions of one run of :func:`inner` under callgrind (with the
    package of ``pythonpath`` first, given)."""
    args = ["--db", db, "--steps", str(steps), "--made", str(made)]
    return callgrind(Path(__file__), args, pythonpath)


def callgrind(
    script: Path, args: list[str], pythonpath: Path | None, env: dict[str, str] | None = None
) -> int:
    """User-space instructions of ``script --inner args`` under callgrind (with the
    package of ``pythonpath`` first, given; ``env`` added to this environment)."""
    env = {**os.environ, **(env or {})}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
        command += [sys.executable, str(script), "--inner", *args]
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        found = re.search(r"Collected : (\d+)", done.stderr)
        if done.returncode != 0 or found is None:
            raise SystemExit(f"the run under callgrind failed:\n{done.stderr[-3000:]}")
        return int(found[1])


def each_version(before: str | None, count: Callable[[str, Path | None], None]) -> None:
    """``count(name, pythonpath)`` for ``before`` (a revision, built as
    ``scale_rounds.py`` builds it), given, then for this tree."""
    with tempfile.TemporaryDirectory() as tmp:
        versions: list[tuple[str, Path | None]] = [("this tree", None)]
        if before:
            versions.insert(0, (before, checkout(before, Path(tmp))))
        try:
            for name, path in versions:
                count(name, path)
        finally:
            if before:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(Path(tmp) / "tree")], capture_output=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    p.add_argument("--steps", type=int, default=2, help="n: the runs take n and 2n steps")
    p.add_argument("--before", help="a revision to count first, built as scale_rounds.py does")
    p.add_argument("--inner", action="store_true", help="one run, in this process")
    p.add_argument("--made", type=int, help="with --inner: steps of bodies made (≥ --steps)")
    args = p.parse_args()
    if args.inner:
        inner(args.db, args.steps, args.made or args.steps)
        return
    bodies = RANKS * args.steps

    def count(name: str, path: Path | None) -> None:
        one = counted(args.db, args.steps, 2 * args.steps, path)
        two = counted(args.db, 2 * args.steps, 2 * args.steps, path)
        print(f"{args.db}, {name}: {(two - one) / bodies:,.0f} instructions a body "
              f"({bodies} bodies in groups of {GROUP}, prepared and stored, no HTTP)",
              flush=True)  # fmt: skip

    each_version(args.before, count)


if __name__ == "__main__":
    main()
