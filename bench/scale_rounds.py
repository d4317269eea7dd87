"""Before and after, measured: ``bench/scale.py`` rounds of an earlier commit and of the
working tree, the order swapped from one round to the next, then ``scale_compare.py``.

The order matters here: on these machines the run that comes first in a round was ~10 %
faster on SQLite whichever version it was (bench/README.md, Scale), so a comparison
that always runs one version first measures the order. Round 1 runs "before" first,
round 2 "after" first, and so on; use an even number of rounds.

"before" is ``--before`` (any revision) checked out into a temporary directory, its
compiled combine built there (``setup.py build_ext --inplace``), and put first on the
servers' ``PYTHONPATH`` under the package name, so that the same interpreter and
environment serve both; "after" is this checkout as installed.

Usage:
    python bench/scale_rounds.py --before cff2ed6 --rounds 4 --out /tmp/rounds \\
        -- --ranks 256 --configs sqlite postgres
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: the package's folders (pyproject.toml's package-dir): steptally.<name> is <name>/
PACKAGES = ("client", "service", "migrations", "integrations")


def checkout(revision: str, into: Path) -> Path:
    """``revision`` built in ``into``; the folder to put first on ``PYTHONPATH``."""
    tree = into / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), revision],
                   check=True, capture_output=True)  # fmt: skip
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                   cwd=tree, check=True, capture_output=True)  # fmt: skip
    path = into / "path"
    (path / "steptally").mkdir(parents=True)
    for name in PACKAGES:
        (path / "steptally" / name).symlink_to(tree / name)
    return path


def run_scale(out: Path, scale_args: list[str], pythonpath: Path | None) -> Path:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    log = out.with_suffix(".log")
    command = [sys.executable, str(HERE / "scale.py"), *scale_args, "--out", str(out)]
    with open(log, "wb") as f:
        done = subprocess.run(command, env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"bench/scale.py failed; see {log}")
    return out / "scale.csv"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", required=True, help="the revision to compare against")
    p.add_argument("--rounds", type=int, default=4, help="rounds (even: each order as often)")
    p.add_argument("--out", type=Path, required=True, help="a folder for the rounds")
    p.add_argument("scale_args", nargs=argparse.REMAINDER, help="-- then bench/scale.py's")
    args = p.parse_args()
    scale_args = [a for a in args.scale_args if a != "--"]
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        before_path = checkout(args.before, Path(tmp))
        try:
            labelled: list[str] = []
            for r in range(1, args.rounds + 1):
                order = [("before", before_path), ("after", None)]
                for version, pythonpath in order if r % 2 else order[::-1]:
                    print(f"round {r}/{args.rounds}: {version}", file=sys.stderr, flush=True)
                    csv_path = run_scale(args.out / f"{version}_{r}", scale_args, pythonpath)
                    labelled.append(f"{version}={csv_path}")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(Path(tmp) / "tree")], capture_output=True)  # fmt: skip
    subprocess.run([sys.executable, str(HERE / "scale_compare.py"), *labelled,
                    "--out", str(args.out / "compare")], check=True)  # fmt: skip


if __name__ == "__main__":
    main()
