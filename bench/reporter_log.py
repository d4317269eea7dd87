"""Reporter benchmark: time on the training thread per step, against an all-reduce.

Each of RANKS local processes (spawned) plays a training rank. Per step it logs
MICROBATCHES fragments of METRICS values with ``Reporter.log()`` and then calls
``commit()``; the clock measures only the calling (training) thread. Between steps
the rank does GAP_MS of CPU matrix products (the rest of a training step), so that the
CPU stays busy as in training. With ``--spread`` the same work is split between the
microbatches (work, ``log()``, work, ``log()``, ...), as a training loop that logs
after each microbatch's backward does: every call then starts with caches that the
work has cooled, as only a step's first call does by default. The reporters post over
real sockets to a minimal HTTP stub in the parent process that answers 200 at once (a
stand-in for a remote service; the service itself is benchmarked by ingest.py), so
their background threads do their real work (batching, encoding, gzip, HTTP) on the
same CPUs as the training threads.

Anchor, measured in the same run by the same processes: what the reporter replaces,
a ``torch.distributed.all_reduce`` (gloo) of the same METRICS values per microbatch,
and, more favourable to the anchor, one all-reduce of all METRICS × MICROBATCHES values
per step.

With ``--why`` each timed call also reads the thread's resource usage before and after
(outside the timed window), and the calls at or above p99 are told apart by what
happened inside them: the thread blocked (a voluntary context switch: waiting for the
GIL or a lock), was preempted by the OS (an involuntary one), ran a cyclic garbage
collection (Python's, in whichever thread crosses the allocation threshold), took a
page fault, or none of these (plain CPU time: cold caches, an interrupt, a shared
core).

Usage:
    python bench/reporter_log.py [--ranks 8] [--steps 300] [--metrics 32] [--microbatches 8]
                                 [--why] [--spread] [--record LABEL]
"""

from __future__ import annotations

import argparse
import csv
import gc
import multiprocessing
import os
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time
import warnings
from array import array
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from operator import attrgetter
from pathlib import Path
from typing import Any

_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
Why = tuple[int, ...]  # voluntary, involuntary switches, page faults, collections, first call
_collections = [0]  # garbage collections run by the main thread


def _count_collection(phase: str, info: dict[str, Any]) -> None:
    if phase == "start" and threading.current_thread() is threading.main_thread():
        _collections[0] += 1


def _usage() -> Why:
    u = resource.getrusage(_THREAD)
    return u.ru_nvcsw, u.ru_nivcsw, u.ru_minflt, _collections[0]


class _Samples:
    """Each timed call's nanoseconds (and, with ``--why``, what happened inside it),
    in arrays allocated up front: the harness makes no Python object per call, so it
    grows no heap that a timed call could be the first to touch (a fresh page of
    Python's small-object allocator is a page fault in whichever call reaches it)."""

    def __init__(self, args: argparse.Namespace, calls: int, steps: int) -> None:
        self.why = args.why
        self.call_ns = array("q", bytes(8 * calls))
        self.step_ns = array("q", bytes(8 * steps))
        self.causes = array("q", bytes(8 * 5 * calls if args.why else 0))
        self.n = self.steps = 0

    def timed(
        self, fn: Callable[..., object], args: tuple[Any, ...], kept: bool, first: bool
    ) -> int:
        """Nanoseconds ``fn(*args)`` took, recorded when ``kept`` (past the warm-up)."""
        clock = time.perf_counter_ns
        if not (kept and self.why):
            t0 = clock()
            fn(*args)
            dt = clock() - t0
        else:
            u0 = _usage()
            t0 = clock()
            fn(*args)
            dt = clock() - t0
            u1 = _usage()
            i = 5 * self.n
            c = self.causes
            c[i], c[i + 1], c[i + 2] = u1[0] - u0[0], u1[1] - u0[1], u1[2] - u0[2]
            c[i + 3], c[i + 4] = u1[3] - u0[3], first
        if kept:
            self.call_ns[self.n] = dt
            self.n += 1
        return dt

    def step(self, ns: int) -> None:
        self.step_ns[self.steps] = ns
        self.steps += 1

    def result(self) -> dict[str, list[Any]]:
        c = self.causes
        return {
            "call": [ns / 1e3 for ns in self.call_ns[: self.n]],
            "step": [ns / 1e3 for ns in self.step_ns[: self.steps]],
            "why": [tuple(c[i : i + 5]) for i in range(0, 5 * self.n if self.why else 0, 5)],
        }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _compute(ms: float) -> None:
    """The rest of a training step: CPU matrix products for about ``ms`` milliseconds."""
    import torch

    a = torch.rand(96, 96)
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        a = torch.mm(a, a).clamp_(-1, 1)


def _time_reporter(
    args: argparse.Namespace, rank: int, url: str, tensors: bool
) -> dict[str, list[Any]]:
    import torch

    from steptally.client.reporter import Reporter

    names = [f"m{i:02d}" for i in range(args.metrics)]
    spec = {"metrics": {n: "sum" for n in names}}
    samples = _Samples(args, args.steps * args.microbatches, args.steps)
    clock = time.perf_counter_ns
    with (
        tempfile.TemporaryDirectory() as spool,
        Reporter(
            url,
            run="bench",
            spec=spec,
            rank=rank,
            world_size=args.ranks,
            spool_dir=spool,
        ) as reporter,
    ):
        for step in range(args.warmup + args.steps):
            rows = []
            for mb in range(args.microbatches):
                row: dict[str, Any] = {n: float(step * 1000 + mb + i) for i, n in enumerate(names)}
                if tensors:
                    row = {n: torch.tensor(v, dtype=torch.float64) for n, v in row.items()}
                rows.append(row)
            kept = step >= args.warmup
            total = 0
            for mb, row in enumerate(rows):
                if args.spread:
                    _compute(args.gap_ms / args.microbatches)
                total += samples.timed(reporter.log, (step, row), kept, mb == 0)
            t0 = clock()
            reporter.commit(step)
            total += clock() - t0
            if kept:
                samples.step(total)
            if not args.spread:
                _compute(args.gap_ms)
        assert reporter.flush(60), reporter.stats()
    return samples.result()


def _time_floor(args: argparse.Namespace, tensors: bool = False) -> dict[str, list[Any]]:
    """What any Python code that looks at every value once costs on this thread: for
    tensors, reading each one's ``_version`` (what keeping a tensor to read later, and
    telling an in-place change after the call, takes at the least)."""
    import torch

    names = [f"m{i:02d}" for i in range(args.metrics)]
    samples = _Samples(args, args.steps * args.microbatches, args.steps)
    kept_rows: list[list[Any]] = []
    version = attrgetter("_version")

    def touch(row: dict[str, Any]) -> None:
        if tensors:
            kept_rows.append(list(map(version, row.values())))
        else:
            kept_rows.append([v for v in row.values() if type(v) is float])

    for step in range(args.warmup + args.steps):
        rows: list[dict[str, Any]] = [
            {n: float(step * 1000 + mb + i) for i, n in enumerate(names)}
            for mb in range(args.microbatches)
        ]
        if tensors:
            rows = [
                {n: torch.tensor(v, dtype=torch.float64) for n, v in row.items()} for row in rows
            ]
        kept = step >= args.warmup
        total = 0
        for mb, row in enumerate(rows):
            if args.spread:
                _compute(args.gap_ms / args.microbatches)
            total += samples.timed(touch, (row,), kept, mb == 0)
        if kept:
            samples.step(total)
        kept_rows.clear()
        if not args.spread:
            _compute(args.gap_ms)
    return samples.result()


def _time_all_reduce(args: argparse.Namespace, fused: bool) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    calls: list[float] = []
    steps: list[float] = []
    clock = time.perf_counter_ns
    width = args.metrics * (args.microbatches if fused else 1)
    per_step = 1 if fused else args.microbatches
    for step in range(args.warmup + args.steps):
        total = 0
        for _ in range(per_step):
            values = torch.full((width,), float(step), dtype=torch.float64)
            t0 = clock()
            dist.all_reduce(values)
            dt = clock() - t0
            total += dt
            if step >= args.warmup:
                calls.append(dt / 1e3)
        if step >= args.warmup:
            steps.append(total / 1e3)
        _compute(args.gap_ms)
    return {"call": calls, "step": steps}


class _Stub:
    """A minimal HTTP server answering every POST with 200, on a thread of the parent."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _rank(rank: int, args: argparse.Namespace, port: int, url: str, out: Any) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Failed to initialize NumPy")
        import torch
        import torch.distributed as dist
    torch.set_num_threads(1)  # ranks share the CPUs: no spinning intra-op thread pools
    if args.why:
        gc.callbacks.append(_count_collection)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks
    )
    results = {}
    for name, run in [
        ("log() floats", lambda: _time_reporter(args, rank, url, tensors=False)),
        ("log() cpu tensors", lambda: _time_reporter(args, rank, url, tensors=True)),
        ("floor: list of the values", lambda: _time_floor(args)),
        ("floor: the tensors' versions", lambda: _time_floor(args, tensors=True)),
        ("all_reduce per microbatch", lambda: _time_all_reduce(args, fused=False)),
        ("all_reduce once per step", lambda: _time_all_reduce(args, fused=True)),
    ]:
        dist.barrier()
        results[name] = run()
    dist.barrier()
    dist.destroy_process_group()
    out.put((rank, results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--metrics", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--gap-ms", type=float, default=20.0, help="CPU work between steps")
    p.add_argument("--why", action="store_true", help="tell apart the causes of the tail")
    p.add_argument(
        "--spread",
        action="store_true",
        help="spread the CPU work over the microbatches (work, log(), work, log(), ...) "
        "as a training loop does, so that every call is a step's first: cold",
    )
    p.add_argument(
        "--record",
        metavar="LABEL",
        help="keep this run's call quantiles as LABEL in bench/results/reporter_log.csv "
        "and redraw bench/results/reporter_log.png from every label kept there",
    )
    args = p.parse_args()
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    stub = _Stub()
    procs = [
        ctx.Process(target=_rank, args=(r, args, port, stub.url, out)) for r in range(args.ranks)
    ]
    for proc in procs:
        proc.start()
    merged: dict[str, dict[str, list[float]]] = {}
    for _ in procs:
        _, results = out.get(timeout=1800)
        for name, samples in results.items():
            for key, xs in samples.items():
                merged.setdefault(name, {}).setdefault(key, []).extend(xs)
    for proc in procs:
        proc.join()
    stub.close()
    _print_table(args, merged)
    if args.record:
        _record(args, merged)


RESULTS = Path(__file__).resolve().parent / "results"
# the quantiles kept per row: dense in the tail, where the target is
QUANTILES = [q / 100 for q in range(1, 90, 2)] + [0.9 + q / 1000 for q in range(0, 100)]
QUANTILES += [0.999, 0.9995, 0.9999]
PLOTTED = (
    "log() floats",
    "log() cpu tensors",
    "floor: list of the values",
    "floor: the tensors' versions",
)


def _record(args: argparse.Namespace, merged: dict[str, dict[str, list[Any]]]) -> None:
    """Replace LABEL's rows in reporter_log.csv with this run's, and redraw the plot."""
    path = RESULTS / "reporter_log.csv"
    rows: list[dict[str, str]] = []
    if path.exists():
        with path.open() as f:
            rows = [r for r in csv.DictReader(f) if r["label"] != args.record]
    load = f"{os.getloadavg()[0]:.2f}"
    for name in PLOTTED:
        calls = merged[name]["call"]
        for q in QUANTILES:
            rows.append(
                {
                    "label": args.record,
                    "row": name,
                    "ranks": str(args.ranks),
                    "quantile": f"{q:.4f}",
                    "us": f"{_quantile(calls, q):.3f}",
                    "load_avg_1m": load,
                }
            )
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    _plot(rows, RESULTS / "reporter_log.png")
    print(f"kept as {args.record!r} in {path}; plot in {path.with_suffix('.png')}")


def _plot(rows: list[dict[str, str]], out: Path) -> None:
    """One panel per row: time per call against the share of calls slower than it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, axes = plt.subplots(1, len(PLOTTED), figsize=(19, 4.8), sharey=True)
    for ax, name in zip(axes, PLOTTED, strict=True):
        for label in labels:
            mine = [r for r in rows if r["label"] == label and r["row"] == name]
            if not mine:
                continue
            xs = [1 - float(r["quantile"]) for r in mine]
            ys = [float(r["us"]) for r in mine]
            ax.plot(xs, ys, marker=".", markersize=3, label=f"{label} ({mine[0]['ranks']} ranks)")
        ax.axhline(20, color="grey", linestyle="--", linewidth=1)
        ax.axvline(0.01, color="grey", linestyle=":", linewidth=1)
        ax.text(0.0105, 21, "target: p99 < 20 µs", color="grey", fontsize=8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.invert_xaxis()
        ax.set_title(name)
        ax.set_xlabel("share of calls slower (log; right = the tail)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("time on the training thread per call, µs (log)")
    axes[0].legend(fontsize=8)
    fig.suptitle("Reporter.log(): 32 metrics per call, 8 calls per step, 2 CPUs")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _print_table(args: argparse.Namespace, merged: dict[str, dict[str, list[Any]]]) -> None:
    print(
        f"{args.ranks} ranks × {args.microbatches} microbatches × {args.metrics} metrics, "
        f"{args.steps} steps, {args.gap_ms:g} ms of CPU work "
        f"{'spread over the microbatches' if args.spread else 'between steps'}, "
        f"{os.cpu_count()} CPUs, python {sys.version.split()[0]}"
    )
    anchor = statistics.median(merged["all_reduce per microbatch"]["step"])
    cols = ("call p50", "call p99", "p99.9", "max", "step p50", "step p99")
    print(f"{'training thread':28}" + "".join(f"{c:>10}" for c in cols) + "  anchor/this")
    for name, s in merged.items():
        calls, step_p50 = s["call"], statistics.median(s["step"])
        row = (
            statistics.median(calls),
            _quantile(calls, 0.99),
            _quantile(calls, 0.999),
            max(calls),
            step_p50,
            _quantile(s["step"], 0.99),
        )
        print(f"{name:28}" + "".join(f"{_us(x):>10}" for x in row) + f"  {anchor / step_p50:.0f}×")
    for name, s in merged.items():
        if s.get("why"):
            print(_causes(name, s["call"], s["why"]))


def _us(x: float) -> str:
    return f"{x:.1f}µ" if x < 1000 else f"{x / 1000:.2f}m"


def _causes(name: str, calls: list[float], why: list[Why]) -> str:
    """What happened inside the calls at or above p99 (the first cause that applies)."""
    cut = _quantile(calls, 0.99)
    tail = [w for c, w in zip(calls, why, strict=True) if c >= cut]
    counts = dict.fromkeys(("blocked", "preempted", "gc", "page fault", "none of these"), 0)
    for w in tail:
        counts[_cause(w)] += 1
    found = ", ".join(f"{k} {n}" for k, n in counts.items())
    blocked = sum(1 for w in why if w[0])
    faulted = sum(1 for w in why if w[2])
    collected = sum(1 for w in why if w[3])
    first = sum(1 for w in tail if w[4])
    return (
        f"{name}: {len(tail)} calls >= p99 ({_us(cut)}): {found}; {first} of them a step's "
        f"first call; of all {len(why)} calls, {blocked} blocked, {faulted} took a page "
        f"fault and {collected} ran a collection"
    )


def _cause(w: Why) -> str:
    voluntary, involuntary, faults, collections = w[:4]
    if voluntary:
        return "blocked"
    if involuntary:
        return "preempted"
    if collections:
        return "gc"
    return "page fault" if faults else "none of these"


if __name__ == "__main__":
    main()
