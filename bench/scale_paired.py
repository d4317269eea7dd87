"""Steptally and VictoriaMetrics in turns: their ratio on a machine whose speed drifts.

``scale.py`` times VictoriaMetrics, then Steptally, each once and a few dozen seconds
apart; on this machine the speed of everything moves by ±20 % within minutes, so one
run's ratio moves as much (0.68–1.35× over 8 runs of one version: bench/README.md,
Scale, stop 21). Here both stay up side by side for the whole run, and the same
clients send them the same rank-steps in turns: a slice of ``--slice-steps`` steps of
every rank to one, then the same slice to the other, round after round, in ABBA order
(VictoriaMetrics first in even rounds, Steptally in odd ones), so that a drift
weighs on both alike; a first round (0) warms both up and is left out of the figures.
VictoriaMetrics imports with its series stored (each series written once before the
clock), as ``scale.py``'s "series stored" anchor; Steptally is one ``steptally serve``
(``--cpus``) on a fresh database, fed ``scale.py``'s reporter bodies.

Printed and written (``<out>.csv``: a row a slice; ``<out>.md``; ``<out>.png``: each
slice's rate over the run, and each round's ratio): each side's rate over all its
slices (bodies over the summed time of its slices), their ratio, each round's ratio
(its slice of each) with their median and how many rounds reach 1.0, each side's CPU a
value (Steptally's server and its database's backends; VictoriaMetrics' process) and
the clients' CPU a request. Every step Steptally took is then checked exact against
an independent reference (``scale.verify_exact``) and VictoriaMetrics' sample count.

``--summarise`` reads several runs' CSVs instead: a line a run, the median of the
runs of each setup, and a plot of them.

Usage:
    python bench/scale_paired.py --db postgres --cpus 1 --out bench/results/x
    python bench/scale_paired.py --db postgres --cpus 1 --client-cpus 0 --out /tmp/y
    python bench/scale_paired.py --summarise /tmp/x.csv /tmp/y.csv --out bench/results/z
    python bench/scale_paired.py --db sqlite --ranks 8 --rounds 2 --slice-steps 4 --out /tmp/p
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import procstat
from ingest import database  # the ingest benchmark's
from loadgen import blast
from scale import (
    RUN,
    VALUES_PER_BODY,
    Backends,
    Window,
    _vm_count,
    ingest_jobs,
    log,
    prepared,
    register_runs,
    replicas,
    verify_exact,
    victoria,
    victoria_jobs,
)

SIDES = ("steptally", "victoria")
COLUMNS = [
    "db",
    "ranks",
    "cpus",
    "client_cpus",
    "round",
    "side",
    "first_step",
    "steps",
    "rank_steps",
    "started_s",
    "elapsed_s",
    "rank_steps_per_s",
    "cpu_us_per_value",
    "client_cpu_us_per_request",
]


@dataclass(frozen=True)
class Slice:
    """One side's turn: what it took, how long, and the CPU it and the clients spent."""

    round: int
    side: str
    first_step: int
    steps: int
    rank_steps: int
    started_s: float
    elapsed_s: float
    cpu_s: float
    client_cpu_s: float

    @classmethod
    def of(cls, row: dict[str, str]) -> Slice:
        """A slice from its CSV row."""
        done = int(row["rank_steps"])
        return cls(
            int(row["round"]), row["side"], int(row["first_step"]), int(row["steps"]), done,
            float(row["started_s"]), float(row["elapsed_s"]),
            float(row["cpu_us_per_value"]) * done * VALUES_PER_BODY / 1e6,
            float(row["client_cpu_us_per_request"]) * done / 1e6,
        )  # fmt: skip

    def row(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "side": self.side,
            "first_step": self.first_step,
            "steps": self.steps,
            "rank_steps": self.rank_steps,
            "started_s": round(self.started_s, 3),
            "elapsed_s": self.elapsed_s,
            "rank_steps_per_s": self.rank_steps / self.elapsed_s,
            "cpu_us_per_value": 1e6 * self.cpu_s / (self.rank_steps * VALUES_PER_BODY),
            "client_cpu_us_per_request": 1e6 * self.client_cpu_s / self.rank_steps,
        }


class _Cpu:
    """A process's CPU from :meth:`start` (the clients' release) on."""

    def __init__(self, pid: int) -> None:
        self.pid, self.at = pid, 0.0

    def start(self) -> None:
        self.at = procstat.cpu_s(self.pid)

    def spent(self) -> float:
        return procstat.cpu_s(self.pid) - self.at


def run(args: argparse.Namespace) -> list[Slice]:
    ranks, width, rounds = args.ranks, args.slice_steps, args.rounds + 1  # round 0: warm-up
    steps = width * rounds
    all_bodies = prepared(ranks, steps)
    slices: list[Slice] = []
    with (
        tempfile.TemporaryDirectory() as logs,
        tempfile.TemporaryDirectory() as storage,
        victoria(Path(storage)) as (vm_port, vm_pid),
        database(args.db) as url,
        replicas(url, 1, None, Path(logs), 1, args.cpus) as servers,
    ):
        backends = Backends(url)
        try:
            base = servers[0].base
            register_runs(base, ranks, args.clients)
            origin = time.monotonic()
            for k in range(rounds):
                span = range(k * width, (k + 1) * width)
                order = SIDES if k % 2 else SIDES[::-1]
                for side in order:
                    if side == "steptally":
                        bodies = all_bodies[span.start : span.stop]
                        jobs = ingest_jobs(bodies, [servers[0].port], args.clients, warm=k == 0)
                        window = Window([servers[0].proc.pid], backends)
                        started = time.monotonic()
                        done = blast(jobs, window.start, cpus=args.client_cpus)
                        window.stop()
                        cpu_s = window.server_s + window.db_s
                    else:
                        jobs = victoria_jobs(vm_port, ranks, span, args.clients, stored=k == 0)
                        clock = _Cpu(vm_pid)
                        started = time.monotonic()
                        done = blast(jobs, clock.start, cpus=args.client_cpus)
                        cpu_s = clock.spent()
                    if done.errors:
                        raise RuntimeError(f"{side}: {len(done.errors)} errors: {done.errors[:3]}")
                    one = Slice(
                        k, side, span.start, width, done.done, started - origin,
                        done.elapsed_s, cpu_s, done.cpu_s,
                    )  # fmt: skip
                    slices.append(one)
                    row = one.row()
                    warm = " (warm-up)" if k == 0 else ""
                    log(
                        f"round {k}/{rounds - 1}{warm} {side:>9}: "
                        f"{row['rank_steps_per_s']:8.1f} rank-steps/s, "
                        f"{row['cpu_us_per_value']:.2f} µs CPU a value"
                    )
            summary = httpx.get(f"{base}/v1/runs/{RUN}").json()["steps"]
            if summary["complete"] != steps:
                raise RuntimeError(f"Steptally: {summary} after {steps} steps")
            verify_exact(base, all_bodies)
            httpx.get(f"http://127.0.0.1:{vm_port}/internal/force_flush").raise_for_status()
            found = _vm_count(vm_port, ranks, steps)
            if found != ranks * steps * VALUES_PER_BODY:
                raise RuntimeError(f"VictoriaMetrics holds {found} of the values")
        finally:
            backends.close()
    return slices


def totals(slices: list[Slice]) -> dict[str, Any]:
    """Each side's rate over its slices, their ratio, each round's ratio and more; the
    warm-up round (0) left out."""
    slices = [s for s in slices if s.round > 0]
    out: dict[str, Any] = {}
    for side in SIDES:
        mine = [s for s in slices if s.side == side]
        done = sum(s.rank_steps for s in mine)
        out[f"{side}_rate"] = done / sum(s.elapsed_s for s in mine)
        out[f"{side}_cpu_us_per_value"] = (
            1e6 * sum(s.cpu_s for s in mine) / (done * VALUES_PER_BODY)
        )
        out[f"{side}_client_cpu_us"] = 1e6 * sum(s.client_cpu_s for s in mine) / done
    out["ratio"] = out["steptally_rate"] / out["victoria_rate"]
    by_round: dict[int, dict[str, Slice]] = {}
    for s in slices:
        by_round.setdefault(s.round, {})[s.side] = s
    rates = [{k: v.rank_steps / v.elapsed_s for k, v in r.items()} for r in by_round.values()]
    out["round_ratios"] = [r["steptally"] / r["victoria"] for r in rates]
    out["median_round_ratio"] = statistics.median(out["round_ratios"])
    out["rounds_at_1"] = sum(r >= 1.0 for r in out["round_ratios"])
    return out


def markdown(args: argparse.Namespace, t: dict[str, Any]) -> str:
    rounds = len(t["round_ratios"])
    lines = [
        f"{args.db}, {args.ranks} ranks, {rounds} rounds of {args.slice_steps} steps "
        f"(`--cpus {args.cpus or '-'}`, {args.clients} clients"
        f"{f' on cores {args.client_cpus}' if args.client_cpus else ''}), in turns (ABBA):",
        "",
        "| | rank-steps/s | CPU µs a value | clients' CPU µs a request |",
        "|---|---|---|---|",
    ]
    for side, name in (("steptally", "Steptally"), ("victoria", "VictoriaMetrics, series stored")):
        lines.append(
            f"| {name} | {t[f'{side}_rate']:,.0f} | {t[f'{side}_cpu_us_per_value']:.2f} "
            f"| {t[f'{side}_client_cpu_us']:.0f} |"
        )
    ratios = ", ".join(f"{r:.2f}" for r in t["round_ratios"])
    lines += [
        "",
        f"× VictoriaMetrics, series stored: **{t['ratio']:.2f}** over all slices; by round "
        f"{ratios} (median {t['median_round_ratio']:.2f}, {t['rounds_at_1']} of {rounds} "
        "rounds ≥ 1.0).",
    ]
    return "\n".join(lines)


def plot(args: argparse.Namespace, slices: list[Slice], t: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=False)
    for side, style, name in (
        ("steptally", "o-", "Steptally"),
        ("victoria", "s--", "VictoriaMetrics, series stored"),
    ):
        mine = [s for s in slices if s.side == side and s.round > 0]
        top.plot(
            [s.started_s for s in mine], [s.rank_steps / s.elapsed_s for s in mine], style,
            label=f"{name}: {t[f'{side}_rate']:,.0f} over all its slices",
        )  # fmt: skip
    top.set_xlabel("seconds into the run (each point a slice)")
    top.set_ylabel("rank-steps/s")
    top.set_ylim(bottom=0)
    top.legend(fontsize=8)
    top.set_title(
        f"{args.db}, {args.ranks} ranks: the two in turns, {args.slice_steps} steps a slice (ABBA)"
    )
    rounds = range(1, len(t["round_ratios"]) + 1)
    bottom.plot(rounds, t["round_ratios"], "o-", label="Steptally ÷ VictoriaMetrics, each round")
    bottom.axhline(
        t["ratio"], color="C1", linestyle=":", label=f"over all slices: {t['ratio']:.2f}"
    )
    bottom.axhline(1.0, color="grey", linewidth=0.8)
    bottom.set_xlabel("round")
    bottom.set_xticks(list(rounds))
    bottom.set_ylabel("ratio")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _path(out: Path, suffix: str) -> Path:
    return out.parent / f"{out.name}.{suffix}"  # a dot in the name stays


def summary(paths: list[Path]) -> list[dict[str, Any]]:
    """Each run (one CSV) as a line: its setup and :func:`totals`."""
    out = []
    for path in paths:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        setup = {k: rows[0][k] for k in ("db", "ranks", "cpus", "client_cpus")}
        out.append({"run": path.name, **setup, **totals([Slice.of(r) for r in rows])})
    return out


def summary_markdown(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| store | ranks | server `--cpus` | clients' cores | run | × VictoriaMetrics, "
        "series stored (over all slices) | rounds ≥ 1.0 | CPU µs a value, Steptally "
        "/ VictoriaMetrics | clients' CPU µs a request, Steptally / VictoriaMetrics |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted({_setup(r) for r in runs}):
        mine = [r for r in runs if _setup(r) == key]
        for r in mine:
            lines.append(
                f"| {' | '.join(map(str, key))} | {r['run']} | {r['ratio']:.2f} "
                f"| {r['rounds_at_1']} of {len(r['round_ratios'])} "
                f"| {r['steptally_cpu_us_per_value']:.2f} / {r['victoria_cpu_us_per_value']:.2f} "
                f"| {r['steptally_client_cpu_us']:.0f} / {r['victoria_client_cpu_us']:.0f} |"
            )
        ratios = [r["ratio"] for r in mine]
        lines.append(
            f"| **{' | '.join(map(str, key))}** | **median of {len(mine)}** "
            f"| **{statistics.median(ratios):.2f}** ({sum(x >= 1.0 for x in ratios)} of "
            f"{len(mine)} runs ≥ 1.0) | | | |"
        )
    return "\n".join(lines)


def _setup(run: dict[str, Any]) -> tuple[str, ...]:
    return (run["db"], str(run["ranks"]), run["cpus"], run["client_cpus"])


def summary_plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({_setup(r) for r in runs})
    fig, ax = plt.subplots(figsize=(1.6 * len(keys) + 4, 5))
    for x, key in enumerate(keys):
        mine = [r for r in runs if _setup(r) == key]
        for r in mine:
            rounds = r["round_ratios"]
            ax.scatter([x + 0.12] * len(rounds), rounds, color="grey", s=8, alpha=0.5)
        ratios = [r["ratio"] for r in mine]
        ax.scatter([x] * len(ratios), ratios, color="C0", zorder=3)
        median = statistics.median(ratios)
        ax.hlines(median, x - 0.25, x + 0.25, color="C1", zorder=4)
        ax.annotate(f"{median:.2f}", (x + 0.27, median), fontsize=8, va="center")
    ax.scatter([], [], color="C0", label="a run, over all its slices")
    ax.scatter([], [], color="grey", s=8, label="a round of a run")
    ax.hlines([], 0, 0, color="C1", label="the median of the runs")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    labels = [
        f"{db}, {ranks} ranks\nserver --cpus {c}\n"
        f"clients on {'any core' if cc == '-' else f'core {cc}'}"
        for db, ranks, c, cc in keys
    ]
    ax.set_xticks(range(len(keys)), labels, fontsize=8)
    ax.set_ylabel("Steptally ÷ VictoriaMetrics (series stored)")
    ax.set_title("scale_paired.py: the two in turns, run by run")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--db", choices=["sqlite", "postgres"], default="postgres")
    p.add_argument("--ranks", type=int, default=256)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--slice-steps", type=int, default=8, help="steps of every rank a slice")
    p.add_argument("--clients", type=int, default=8, help="client processes")
    p.add_argument("--cpus", default=None, help="steptally serve --cpus (unset: unpinned)")
    p.add_argument(
        "--client-cpus",
        default=None,
        help="the client processes' cores, e.g. 0 (unset: where the kernel puts them)",
    )
    p.add_argument("--out", type=Path, required=True, help="the outputs' path, no suffix")
    p.add_argument(
        "--summarise",
        nargs="+",
        type=Path,
        default=None,
        help="instead of a run: these runs' CSVs, one line each and their medians",
    )
    args = p.parse_args(argv)
    if args.summarise is not None:
        runs = summary(args.summarise)
        text = summary_markdown(runs)
        _path(args.out, "md").write_text(text + "\n")
        summary_plot(runs, _path(args.out, "png"))
        print(text)
        print(f"wrote {args.out}.md and .png")
        return
    slices = run(args)
    t = totals(slices)
    with open(_path(args.out, "csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        setup = {"db": args.db, "ranks": args.ranks, "cpus": args.cpus or "-"}
        setup["client_cpus"] = args.client_cpus or "-"
        writer.writerows({**setup, **s.row()} for s in slices)
    text = markdown(args, t)
    _path(args.out, "md").write_text(text + "\n")
    plot(args, slices, t, _path(args.out, "png"))
    print(text)
    print(f"wrote {args.out}.csv, .md and .png")


if __name__ == "__main__":
    main()
