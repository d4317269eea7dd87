"""Before and after: several ``bench/scale.py`` CSVs of two versions, as one table and plot.

Each CSV is labelled with its version (``before=path`` or ``after=path``, or any two
names, such as ``threads=path`` and ``process=path``: the first name given is drawn
hollow, the second filled; run them interleaved, as rounds, so that the machine's drift
falls on both). Per version,
configuration and rank count it takes the median over the CSVs of: rank-steps/s, the
ratio to VictoriaMetrics measured beside that row, the ratio to the HTTP floor, server
+ database CPU per value and the finalise p99; every row's ``steps_exact`` must equal
its steps (``bench/scale.py`` raises before writing a row that is not exact).

Usage:
    python bench/scale_compare.py before=old_1/scale.csv after=new_1/scale.csv ... \\
        --out bench/results/scale_issue21
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from rank_axes import rank_axes

FIELDS = {
    "rank_steps_per_s": "rank-steps/s",
    "victoria_ratio": "× VictoriaMetrics",
    "floor_ratio": "× HTTP floor",
    "server_cpu_us_per_value": "server + db CPU µs/value",
    "finalise_p99_ms": "finalise p99 ms",
}


def read(labelled: list[str]) -> dict[tuple[str, str, int], dict[str, list[float]]]:
    out: dict[tuple[str, str, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for item in labelled:
        version, path = item.split("=", 1)
        with open(path) as f:
            for row in csv.DictReader(f):
                if row.get("steps_exact") not in (None, "", row["steps"]):
                    raise SystemExit(f"{path}: {row['config']} {row['ranks']} not exact")
                key = (version, row["config"], int(row["ranks"]))
                for field in FIELDS:
                    out[key][field].append(float(row[field]))
                out[key]["victoria"].append(float(row["victoria_rank_steps_per_s"]))
                if row.get("victoria_stored_ratio"):  # CSVs from before it have none
                    out[key]["victoria_stored_ratio"].append(float(row["victoria_stored_ratio"]))
                    stored = float(row["victoria_stored_rank_steps_per_s"])
                    out[key]["victoria_stored"].append(stored)
    return out


def medians(data: dict[tuple[str, str, int], dict[str, list[float]]]) -> list[dict[str, Any]]:
    rows = []
    for (version, config, ranks), fields in sorted(data.items()):
        row: dict[str, Any] = {"version": version, "config": config, "ranks": ranks}
        row["runs"] = len(fields["rank_steps_per_s"])
        for field, values in fields.items():
            row[field] = statistics.median(values)
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], versions: list[str]) -> str:
    names = list(FIELDS.values())
    names.insert(2, "× VictoriaMetrics, series stored")
    head = "| config | ranks | version | runs | " + " | ".join(names) + " |"
    out = [head, "|" + "---|" * (4 + len(names))]
    for r in sorted(rows, key=lambda r: (r["config"], r["ranks"], versions.index(r["version"]))):
        cells = [
            f"{r['rank_steps_per_s']:.0f}",
            f"{r['victoria_ratio']:.2f} ({r['victoria']:.0f})",
            (
                f"{r['victoria_stored_ratio']:.2f} ({r['victoria_stored']:.0f})"
                if "victoria_stored" in r
                else "—"
            ),
            f"{r['floor_ratio']:.3f}",
            f"{r['server_cpu_us_per_value']:.1f}",
            f"{r['finalise_p99_ms']:.1f}",
        ]
        out.append(
            f"| {r['config']} | {r['ranks']} | {r['version']} | {r['runs']} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(out)


def _values(ax: Any, x: list[int], y: list[float], fmt: str, colour: str | None) -> None:
    """Each point's value written beside it."""
    for xi, yi in zip(x, y, strict=True):
        ax.annotate(fmt.format(yi), (xi, yi), xytext=(6, 0), textcoords="offset points",
                    va="center", fontsize=8, color=colour)  # fmt: skip


def plot(rows: list[dict[str, Any]], versions: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate, cpu) = plt.subplots(1, 2, figsize=(16, 5.2))
    colours = {"sqlite": "tab:blue", "postgres": "tab:orange"}
    for config in sorted({r["config"] for r in rows}):
        for version, (style, face) in zip(versions, (("o:", "none"), ("s-", None)), strict=True):
            mine = sorted(
                (r for r in rows if r["config"] == config and r["version"] == version),
                key=lambda r: r["ranks"],
            )
            if not mine:
                continue
            colour = colours.get(config.split()[0])
            x = [r["ranks"] for r in mine]
            label = f"{config}, {version}"
            for ax, field, fmt in (
                (rate, "rank_steps_per_s", "{:,.0f}"),
                (cpu, "server_cpu_us_per_value", "{:.1f}"),
            ):
                y = [r[field] for r in mine]
                ax.plot(x, y, style, color=colour, markerfacecolor=face, label=label)
                _values(ax, x, y, fmt, colour)
    xs = sorted({r["ranks"] for r in rows})
    for key, style, label in (
        ("victoria", "D--", "VictoriaMetrics, new series (median beside the rows)"),
        ("victoria_stored", "d:", "VictoriaMetrics, series stored (median)"),
    ):
        vm: dict[int, list[float]] = defaultdict(list)
        for r in rows:
            if key in r:
                vm[r["ranks"]].append(r[key])
        at = [x for x in xs if x in vm]
        vm_rate = [statistics.median(vm[x]) for x in at]
        rate.plot(at, vm_rate, style, color="grey", label=label)
        _values(rate, at, vm_rate, "{:,.0f}", "grey")
    for ax, title in (
        (rate, "rank-steps/s (higher is better), 2 shared cores"),
        (cpu, "server + database CPU per value, µs (lower is better)"),
    ):
        rank_axes(ax, xs, title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("csvs", nargs="+", help="before=PATH or after=PATH (or two other names)")
    p.add_argument("--out", type=Path, required=True, help="PATH.csv, PATH.png, PATH.md")
    args = p.parse_args()
    versions = list(dict.fromkeys(item.split("=", 1)[0] for item in args.csvs))
    if len(versions) != 2:
        p.error(f"two versions to compare, not {len(versions)}: {', '.join(versions)}")
    rows = medians(read(args.csvs))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for row in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    plot(rows, versions, args.out.with_suffix(".png"))
    table = markdown(rows, versions)
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
