"""What one group of the writer costs, by its size: the writer's CPU and the database's.

``bench/scale.py`` measures ingest end to end over HTTP, where the group sizes are what
the clients' timing makes them. This bench takes the HTTP away and stores groups of a
chosen size straight through the store's writer path (``SqlStore._ingest_group``, on
this thread, with the writer's own connection), reporter-shaped bodies of one rank-step
each (8 microbatches × 32 metrics, as in ``scale.py``), so that a group's cost splits
into a fixed part and a part per body: the writer's CPU (``time.thread_time``: the
Python work and the driver's, and SQLite's own work, which runs in that thread) and,
on PostgreSQL, the CPU of the database's backends (``/proc``). The sizes take turns
within each step, so a drift of the machine touches them alike; the first two steps
are left out (warm-up). A least-squares line through the per-group means gives the
fixed cost and the cost per body.

At ``--ranks 8`` every group of 8 completes a step, and its finalisation (after the
commit) is counted in the group's cost.

Usage:
    python bench/group_cost.py --db postgres              # 256 ranks, sizes 1–32
    python bench/group_cost.py --db sqlite --sizes 2 8
    python bench/group_cost.py --db postgres --ranks 8 --sizes 8
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from steptally.service.app import create_app
from steptally.service.settings import Settings
from steptally.service.store.group_commit import Pending, batch_bytes

sys.path.insert(0, str(Path(__file__).parent))
from ingest import bodies, database, spec  # the ingest benchmark's
from scale import Backends  # the CPU of a database's backends, as scale.py reads it

MICROBATCHES = 8
METRICS = 32


def fit(sizes: list[int], means: list[float]) -> tuple[float, float]:
    """Least squares ``mean = fixed + per_body × size``: (fixed, per_body)."""
    n = len(sizes)
    if n < 2:
        return means[0], 0.0
    mx, my = sum(sizes) / n, sum(means) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, means, strict=True)) / sxx
    return my - slope * mx, slope


def per_step(ranks: int, sizes: list[int]) -> dict[int, int]:
    """Whole groups of each size in one step of ``ranks`` bodies, the sizes taking turns."""
    out = dict.fromkeys(sizes, 0)
    i = k = 0
    while i < ranks:
        size = sizes[k % len(sizes)]
        k += 1
        if i + size <= ranks:
            out[size] += 1
        i += size
    if not all(out.values()):
        raise SystemExit(f"a step of {ranks} ranks holds no whole group of each of {sizes}")
    return out


def measure(args: argparse.Namespace, url: str) -> list[dict[str, Any]]:
    migrate = [sys.executable, "-m", "steptally.service.cli", "migrate", "--database-url", url]
    subprocess.run(migrate, check=True, capture_output=True)
    app = create_app(Settings(database_url=url), sweep=False)
    shape = argparse.Namespace(ranks=args.ranks, microbatches=MICROBATCHES)
    names = list(spec(METRICS)["metrics"])
    totals = {g: [0, 0.0, 0.0, 0.0] for g in args.sizes}  # groups, writer s, db s, wall s
    backends = Backends(url)
    steps = 2 + max(-(-args.groups // n) for n in per_step(args.ranks, args.sizes).values())
    with TestClient(app) as client:
        run = {"name": "bench", "world_size": args.ranks, "step_timeout_s": 3600, **spec(METRICS)}
        client.post("/v1/runs", json=run).raise_for_status()
        ingest, store = app.state.service.ingest, app.state.store
        t0 = time.monotonic()
        for step in range(steps):
            prepared = [ingest.prepare("bench", b) for b in bodies(shape, names, [step])]
            i = k = 0
            while i < len(prepared):
                size = args.sizes[k % len(args.sizes)]
                k += 1
                items = [
                    Pending(p.run, p.batch, time.time(), batch_bytes(p.batch))
                    for p in prepared[i : i + size]
                ]
                i += size
                db0, cpu0, wall0 = backends.cpu(), time.thread_time(), time.perf_counter()
                store._ingest_group(items)
                wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
                db = sum(c - db0.get(pid, 0.0) for pid, c in backends.cpu().items())
                if any(p.error is not None for p in items):
                    raise RuntimeError(f"a batch failed: {[p.error for p in items]}")
                if step >= 2 and len(items) == size:
                    t = totals[size]
                    t[0], t[1], t[2], t[3] = t[0] + 1, t[1] + cpu, t[2] + db, t[3] + wall
            print(f"step {step + 1}/{steps} ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    backends.close()
    return [
        {
            "db": args.db,
            "ranks": args.ranks,
            "size": g,
            "groups": n,
            "writer_ms": 1e3 * w / n,
            "db_ms": 1e3 * d / n,
            "wall_ms": 1e3 * s / n,
        }
        for g, (n, w, d, s) in totals.items()
        if n
    ]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    sizes = [int(r["size"]) for r in rows]
    sqlite = rows[0]["db"] == "sqlite"  # its database work runs in the writer's thread
    series = [("writer_ms", "writer CPU" + (" (SQLite's work in it)" if sqlite else ""))]
    series += [] if sqlite else [("db_ms", "database CPU")]
    for key, label in [*series, ("wall_ms", "wall")]:
        ys = [float(r[key]) for r in rows]
        fixed, per = fit(sizes, ys)
        ax.plot(sizes, ys, "o-", label=f"{label}: {fixed:.2f} ms + {1e3 * per:.0f} µs a body")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("bodies in the group (one rank-step of 8 × 32 values each)")
    ax.set_ylabel("ms a group")
    ax.set_title(f"one group's cost, {rows[0]['db']}, {rows[0]['ranks']} ranks")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--db", choices=["sqlite", "postgres"], default="postgres")
    p.add_argument("--ranks", type=int, default=256)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--groups", type=int, default=150, help="groups of each size at least")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with database(args.db) as url:
        rows = measure(args, url)
    stem = args.out / f"group_cost_{args.db}_{args.ranks}"
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print("| size | groups | writer CPU ms | database CPU ms | wall ms | CPU µs a body |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        per_body = 1e3 * (r["writer_ms"] + r["db_ms"]) / r["size"]
        print(
            f"| {r['size']} | {r['groups']} | {r['writer_ms']:.3f} | {r['db_ms']:.3f} "
            f"| {r['wall_ms']:.3f} | {per_body:.0f} |"
        )
    sizes = [r["size"] for r in rows]
    for key in ("writer_ms", "db_ms"):
        fixed, per = fit(sizes, [r[key] for r in rows])
        print(f"{key}: {fixed:.3f} ms fixed + {1e3 * per:.1f} µs a body")
    if len(rows) > 1:
        plot(rows, stem.with_suffix(".png"))
    print(f"wrote {stem}.csv" + (" and .png" if len(rows) > 1 else ""), file=sys.stderr)


if __name__ == "__main__":
    main()
