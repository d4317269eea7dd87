"""Several ``bench/scale.py`` runs of one version, run by run: where a goal stands when
the machine's drift moves every run (bench/README.md, Scale).

For each configuration and rank count, each run's rank-steps/s beside the
VictoriaMetrics measured in the same run (its series stored, and new), the ratio to
it, the ratio to the HTTP floor, and the clients' own CPU a request, which tells a run
the machine slowed as a whole (marked "slowed": over 1.5× the median of every run's;
the clients do the same work in every run); then the median over the runs and how many
runs reach 1.0× VictoriaMetrics with its series stored. Writes ``<out>.csv`` (every
row, with its run), ``<out>.md`` (the table) and ``<out>.png`` (the ratios run by run,
a slowed row shaded).

Usage:
    python bench/scale_runs.py run1/scale.csv run2/scale.csv ... --out bench/results/x
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path
from typing import Any


def read(paths: list[Path]) -> list[dict[str, Any]]:
    rows = []
    for run, path in enumerate(paths, 1):
        with open(path) as f:
            for row in csv.DictReader(f):
                if row.get("steps_exact") not in (None, "", row["steps"]):
                    raise SystemExit(f"{path}: {row['config']} {row['ranks']} not exact")
                rows.append({"run": run, **row})
    return rows


#: a run whose clients' CPU a request is this many times the median's: the machine slowed
SLOWED = 1.5


def _row(r: dict[str, Any]) -> tuple[int, str, int]:
    return int(r["run"]), r["config"], int(r["ranks"])


def slowed(rows: list[dict[str, Any]]) -> set[tuple[int, str, int]]:
    """The rows (run, config, ranks) during which the machine slowed as a whole (see
    the module)."""
    cpu = [float(r["client_cpu_us_per_request"]) for r in rows]
    median = statistics.median(cpu)
    return {_row(r) for r, c in zip(rows, cpu, strict=True) if c > SLOWED * median}


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| config | ranks | run | rank-steps/s | VictoriaMetrics, series stored (new) "
        "| × VictoriaMetrics, series stored (new) | × HTTP floor | clients' CPU µs a request |",
        "|---|---|---|---|---|---|---|---|",
    ]
    slow = slowed(rows)
    for key in sorted({(r["config"], int(r["ranks"])) for r in rows}):
        mine = [r for r in rows if (r["config"], int(r["ranks"])) == key]
        for r in mine:
            out.append(
                f"| {key[0]} | {key[1]} | {r['run']} | {float(r['rank_steps_per_s']):,.0f} "
                f"| {float(r['victoria_stored_rank_steps_per_s']):,.0f} "
                f"({float(r['victoria_rank_steps_per_s']):,.0f}) "
                f"| {float(r['victoria_stored_ratio']):.2f} ({float(r['victoria_ratio']):.2f}) "
                f"| {float(r['floor_ratio']):.2f} "
                f"| {float(r['client_cpu_us_per_request']):.0f}"
                f"{' (slowed)' if _row(r) in slow else ''} |"
            )
        ratios = [float(r["victoria_stored_ratio"]) for r in mine]
        reached = sum(x >= 1.0 for x in ratios)
        out.append(
            f"| **{key[0]}** | **{key[1]}** | **median of {len(mine)}** "
            f"| **{statistics.median(float(r['rank_steps_per_s']) for r in mine):,.0f}** "
            f"| **{statistics.median(float(r['victoria_stored_rank_steps_per_s']) for r in mine):,.0f}** "  # noqa: E501
            f"| **{statistics.median(ratios):.2f}** ({reached} of {len(mine)} runs ≥ 1.0) "
            f"| **{statistics.median(float(r['floor_ratio']) for r in mine):.2f}** "
            f"| {sum(_row(r) in slow for r in mine)} slowed |"
        )
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["config"], int(r["ranks"])) for r in rows})
    slow = slowed(rows)
    fig, axes = plt.subplots(1, len(keys), figsize=(6.5 * len(keys), 5.2), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        mine = [r for r in rows if (r["config"], int(r["ranks"])) == key]
        runs = [int(r["run"]) for r in mine]
        for field, style, label in (
            ("victoria_stored_ratio", "o-", "× VictoriaMetrics, its series stored"),
            ("victoria_ratio", "s:", "× VictoriaMetrics, its series new"),
            ("floor_ratio", "^--", "× the HTTP floor"),
        ):
            y = [float(r[field]) for r in mine]
            ax.plot(runs, y, style, label=label)
            for x, v in zip(runs, y, strict=True):
                ax.annotate(f"{v:.2f}", (x, v), xytext=(4, 4), textcoords="offset points",
                            fontsize=8)  # fmt: skip
        for i, r in enumerate(r for r in mine if _row(r) in slow):
            x = int(r["run"])
            label = "the machine slowed (clients' CPU)" if i == 0 else None
            ax.axvspan(x - 0.4, x + 0.4, color="grey", alpha=0.15, label=label)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_title(f"{key[0]}, {key[1]} ranks")
        ax.set_xlabel("run (each with its own VictoriaMetrics and floor)")
        ax.set_xticks(runs)
        ax.set_ylabel("ratio")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("csvs", nargs="+", type=Path, help="bench/scale.py's scale.csv, one a run")
    p.add_argument("--out", type=Path, required=True, help="the outputs' path, no suffix")
    args = p.parse_args()
    rows = read(args.csvs)
    with open(args.out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    text = table(rows)
    args.out.with_suffix(".md").write_text(text + "\n")
    plot(rows, args.out.with_suffix(".png"))
    print(text)
    print(f"wrote {args.out}.csv, .md and .png")


if __name__ == "__main__":
    main()
