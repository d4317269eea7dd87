"""Two versions of the ingest in interleaved pairs of ``bench/scale_ingest.py`` runs:
"before" (``--before REV``, built in a temporary worktree as ``scale_rounds.py`` builds
it, or this tree with ``--before-env``) and "after" (this tree, with ``--after-env``),
the order swapped from one pair to the next.

On these machines the same run's rate drifts by ±15 % from minute to minute, which
moves one run more than most changes do; a pair's two runs are a minute apart at most,
so the median of the pairs' ratios (after ÷ before) tells a change of a few per cent
where single runs cannot. Printed: each run's rank-steps/s, server CPU and database CPU
a body (PostgreSQL's processes; 0 on SQLite), each version's median, and the median
ratio of the pairs.

Usage:
    python bench/ingest_pairs.py --before fd73896 --pairs 6 -- --db sqlite --cpus 1
    python bench/ingest_pairs.py --before-env STEPTALLY_INGEST_LOOP_WRITER=false \\
        --pairs 6 -- --db postgres --cpus 1
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from scale_rounds import ROOT, checkout

HERE = Path(__file__).resolve().parent
LINE = re.compile(r"(\d+) rank-steps/s, server CPU (\d+) µs a body.*database CPU (\d+) µs")


def one(args: list[str], pythonpath: Path | None, env_extra: list[str]) -> tuple[int, int, int]:
    """One ``scale_ingest.py`` run: its rank-steps/s, server and database CPU µs a body."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    for item in env_extra:
        name, _, value = item.partition("=")
        env[name] = value
    done = subprocess.run(
        [sys.executable, str(HERE / "scale_ingest.py"), *args],
        env=env,
        capture_output=True,
        text=True,
    )
    found = LINE.search(done.stdout)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"bench/scale_ingest.py failed:\n{done.stdout}\n{done.stderr}")
    return int(found[1]), int(found[2]), int(found[3])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", help="the revision to compare against (default: this tree)")
    p.add_argument("--before-env", nargs="*", default=[], help="NAME=VALUE for 'before'")
    p.add_argument("--after-env", nargs="*", default=[], help="NAME=VALUE for 'after'")
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("ingest_args", nargs=argparse.REMAINDER, help="-- then scale_ingest.py's")
    args = p.parse_args()
    ingest_args = [a for a in args.ingest_args if a != "--"]
    runs: dict[str, list[tuple[int, int, int]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        before_path = checkout(args.before, Path(tmp)) if args.before else None
        try:
            for i in range(args.pairs):
                order = [("before", before_path, args.before_env), ("after", None, args.after_env)]
                for version, path, env in order if i % 2 == 0 else order[::-1]:
                    rate, cpu, db = one(ingest_args, path, env)
                    runs[version].append((rate, cpu, db))
                    print(f"pair {i + 1}/{args.pairs} {version:6}: {rate:6} rank-steps/s, "
                          f"server CPU {cpu} µs a body, database CPU {db} µs a body",
                          file=sys.stderr, flush=True)  # fmt: skip
        finally:
            if before_path is not None:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(Path(tmp) / "tree")], capture_output=True)  # fmt: skip
    for version, got in runs.items():
        rates, cpus, dbs = ([g[k] for g in got] for k in range(3))
        print(f"{version:6}: median {statistics.median(rates):7.0f} rank-steps/s "
              f"({min(rates)}–{max(rates)}), server CPU {statistics.median(cpus):.0f} µs "
              f"a body, database CPU {statistics.median(dbs):.0f} µs a body")  # fmt: skip
    pairs = list(zip(runs["before"], runs["after"], strict=True))
    rate_ratio = statistics.median(a[0] / b[0] for b, a in pairs)
    cpu_ratio = statistics.median(a[1] / b[1] for b, a in pairs)
    both = statistics.median((a[1] + a[2]) / (b[1] + b[2]) for b, a in pairs)
    print(f"after ÷ before, median of {len(pairs)} pairs: rank-steps/s {rate_ratio:.3f}, "
          f"server CPU a body {cpu_ratio:.3f}, server and database CPU a body "
          f"{both:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
