"""Scale benchmark: reporter-shaped ingest from 8 to 4096 ranks, per store configuration.

Each rank-step is one body (8 microbatch fragments × 32 metrics and the rank's commit,
compact form), as the reporter sends it. For every rank count and configuration —
SQLite; PostgreSQL; PostgreSQL + Redis (``STEPTALLY_REDIS_URL``) with 1 and with 2
replicas, each replica a real ``steptally serve`` process on its own port, on one
database — fresh servers and a fresh database take a few steps of every rank from
``--clients`` client processes (bench/loadgen.py: requests prepared before the clock,
one keep-alive connection each, client i on replica i mod replicas, ranks dealt out
round-robin, every client working through the steps in order).

Measured per row, in the same run:
  * rank-steps/s and values/s (bodies answered ÷ time from the release of the clients
    to the last answer);
  * the HTTP floor: as many ``GET /healthz`` as bodies, by the same client code and
    connections, to the same replicas; ``floor_ratio`` = rank-steps/s ÷ floor requests/s;
  * the Pushgateway (``prometheus-pushgateway``, default settings) at the same rank
    count, once per rank count: each rank's group holds its 256 values, and a rank-step
    is one ``PUT`` of them; the groups of every rank are loaded first (pushed with the
    consistency check off, persisted, and the gateway restarted with it on), then the
    same clients push for at most ``--pushgateway-s`` seconds;
  * VictoriaMetrics (``victoria-metrics``, Debian's package) beside every row: the
    same rank-steps by the same clients, each one ``POST`` of its 256 values to
    ``/api/v1/import/prometheus`` (one series per metric, rank and microbatch, the step
    as the timestamp), every value counted back afterwards; its CPU per value and the
    machine's busy share over the same kind of window as the rows' (so a rate can be
    told apart from an efficiency: a peer that fills both cores is CPU-bound, a store
    that leaves them half idle is bound by its waits); and its own HTTP floor
    (``GET /health``). Twice: with every series of the timed rank-steps new, as the
    first step of a run brings them (``victoria_*``), and with them stored already, a
    step of every rank imported before the clock (``victoria_stored_*``), as in the
    rest of a run: VictoriaMetrics's cost per value is ~2.5× lower once its series
    exist, while Steptally's is the same at every step (bench/README.md, Scale);
  * finalise latency of each step: the ``time.monotonic()`` at which the step's event
    arrived on an event stream (``GET /v1/runs/bench/events``, a separate process,
    connected to replica 0) minus the time at which the client got the answer of the
    step's completing commit (the body whose answer lists the step in ``finalised``;
    when no answer does, the step's last answer). Negative when the event overtakes the
    answer; p50 and p99 over the steps;
  * CPU seconds of the server processes, of the PostgreSQL backends of the run's
    database, of the clients, and of the whole machine, over the timed window; of the
    servers' main threads apart (each serving process's event loop: its CPU a request
    and how busy it was, ``loop_*``); the peak resident memory (VmHWM) of the largest
    replica.

With ``--turns N``, each row of one process on one database is then also measured as
``scale_paired.py`` measures it (``turns_*``): a fresh server and database beside a
fresh VictoriaMetrics with its series stored, the same clients sending each the same
slice of steps (about ``--turn-bodies`` rank-steps) in turns, ABBA, N rounds after a
warm-up round. A single row's ratio to its anchor moves by ±30 % with the machine from
run to run; in turns, both sides see the same drift. ``--client-cpus`` keeps the client
processes on given cores (off the server's, as trainers on other machines are).

Writes ``scale.csv`` and ``scale.png`` (``scale_quick.*`` with ``--quick``) to ``--out``.

Usage:
    python bench/scale.py                 # 8, 64, 512, 4096 ranks × 4 configurations
    python bench/scale.py --quick         # 8 and 64 ranks, SQLite only (< 1 minute)
    python bench/scale.py --ranks 8 64 --configs sqlite postgres
    python bench/scale.py --ranks 256 --configs postgres --cpus - 1   # unpinned, then on core 1
    python bench/scale.py --ranks 8 256 4096 --configs sqlite postgres --cpus 1 \
        --client-cpus 0 --turns 30          # each row also in turns with VictoriaMetrics
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import redis
import sqlalchemy as sa

from steptally.client.wire import decode_batch

sys.path.insert(0, str(Path(__file__).parent))
import procstat
from ingest import PG_ADMIN, bodies, database, free_port, spec  # the ingest benchmark's
from loadgen import Blast, Job, Listener, blast, request
from rank_axes import rank_axes

MICROBATCHES = 8
METRICS = 32
VALUES_PER_BODY = MICROBATCHES * METRICS
REDIS_URL = "redis://127.0.0.1:6379/0"
RUN = "bench"
WARM = "warm"


@dataclass(frozen=True)
class Config:
    name: str
    db: str  # sqlite | postgres
    redis: bool
    replicas: int
    workers: int = 1  # steptally serve --workers N, each replica
    cpus: str | None = None  # steptally serve --cpus, each replica

    def serving(self, workers: int, cpus: str | None) -> Config:
        """This configuration served by ``--workers workers`` (and ``--cpus cpus``)."""
        name = self.name + (f" {workers}w" if workers > 1 else "")
        name += f" cpus={cpus}" if cpus is not None else ""
        return Config(name, self.db, self.redis, self.replicas, workers, cpus)


CONFIGS = {
    c.name: c
    for c in (
        Config("sqlite", "sqlite", False, 1),
        Config("postgres", "postgres", False, 1),
        Config("postgres+redis", "postgres", True, 1),
        Config("postgres+redis×2", "postgres", True, 2),
    )
}
COLUMNS = [
    "config",
    "store",
    "redis",
    "replicas",
    "workers",
    "cpus",
    "ranks",
    "steps",
    "rank_steps",
    "values",
    "elapsed_s",
    "rank_steps_per_s",
    "values_per_s",
    "us_per_value",
    "floor_requests_per_s",
    "floor_ratio",
    "pushgateway_rank_steps_per_s",
    "pushgateway_ratio",
    "victoria_rank_steps_per_s",
    "victoria_ratio",
    "victoria_floor_ratio",
    "victoria_cpu_us_per_value",
    "victoria_busy_share",
    "victoria_stored_rank_steps_per_s",
    "victoria_stored_ratio",
    "victoria_stored_cpu_us_per_value",
    "finalise_p50_ms",
    "finalise_p99_ms",
    "completing_rtt_p50_ms",
    "completing_rtt_p99_ms",
    "rtt_p50_ms",
    "server_cpu_s",
    "db_cpu_s",
    "client_cpu_s",
    "machine_cpu_s",
    "machine_busy_share",
    "server_cpu_us_per_value",
    "loop_cpu_us_per_request",
    "loop_busy_share",
    "client_cpu_us_per_request",
    "floor_server_cpu_us_per_request",
    "floor_client_cpu_us_per_request",
    "peak_rss_mb",
    "load_avg_1m",
    "steps_exact",
    "client_cpus",
    "turns_rounds",
    "turns_slice_steps",
    "turns_rank_steps_per_s",
    "turns_victoria_rank_steps_per_s",
    "turns_ratio",
    "turns_median_round_ratio",
    "turns_rounds_at_1",
    "turns_cpu_us_per_value",
    "turns_victoria_cpu_us_per_value",
]
TURNS = [c for c in COLUMNS if c.startswith("turns_")]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- servers


@dataclass
class Replica:
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _env(redis_prefix: str | None) -> dict[str, str]:
    # the caller's settings stay out, but for the ingest ones (to compare them)
    keep = ("STEPTALLY_INGEST_",)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("STEPTALLY_") or k.startswith(keep)
    }
    if redis_prefix is not None:
        env["STEPTALLY_REDIS_URL"] = REDIS_URL
        env["STEPTALLY_REDIS_PREFIX"] = redis_prefix
    return env


@contextmanager
def replicas(
    url: str,
    n: int,
    redis_prefix: str | None,
    logs: Path,
    workers: int = 1,
    cpus: str | None = None,
) -> Iterator[list[Replica]]:
    """``n`` ``steptally serve --workers workers`` processes on one migrated database,
    each on its port (and on the cores ``cpus``, given)."""
    exe = [sys.executable, "-m", "steptally.service.cli"]
    serve = [*exe, "serve", "--database-url", url, "--host", "127.0.0.1", "--workers"]
    serve += [str(workers), *(["--cpus", cpus] if cpus is not None else []), "--port"]
    env = _env(redis_prefix)
    migrated = subprocess.run([*exe, "migrate", "--database-url", url], capture_output=True)
    if migrated.returncode != 0:
        raise RuntimeError(f"steptally migrate failed:\n{migrated.stderr.decode()[-2000:]}")
    started: list[Replica] = []
    try:
        for i in range(n):
            port = free_port()
            with open(logs / f"replica-{i}.log", "ab") as out:
                proc = subprocess.Popen(
                    [*serve, str(port)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            started.append(Replica(port, proc))
        for i, r in enumerate(started):
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{r.base}/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if r.proc.poll() is not None or time.monotonic() > deadline:
                    text = (logs / f"replica-{i}.log").read_text()[-2000:]
                    raise RuntimeError(f"steptally serve did not start:\n{text}")
                time.sleep(0.05)
        yield started
    finally:
        for r in started:
            r.proc.terminate()
        for r in started:
            try:
                r.proc.wait(15)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()


def delete_prefix(prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)
    finally:
        client.close()


class Backends:
    """CPU of the PostgreSQL backends serving one database (none for SQLite)."""

    def __init__(self, url: str) -> None:
        self._db = url.rsplit("/", 1)[1] if url.startswith("postgresql") else None
        self._engine = sa.create_engine(PG_ADMIN) if self._db else None

    def cpu(self) -> dict[int, float]:
        if self._engine is None:
            return {}
        with self._engine.connect() as c:
            pids = c.execute(
                sa.text("SELECT pid FROM pg_stat_activity WHERE datname = :db"), {"db": self._db}
            ).scalars()
            return {int(pid): procstat.cpu_s(int(pid)) for pid in pids}

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()


class Window:
    """CPU counters read at the release of the clients and after the last answer."""

    def __init__(self, servers: list[int], backends: Backends) -> None:
        self._servers, self._backends = servers, backends
        self.server_s = self.db_s = self.machine_s = self.loop_s = 0.0

    def start(self) -> None:
        self._servers = [p for pid in self._servers for p in procstat.family(pid)]
        self._s0 = [procstat.cpu_s(p) for p in self._servers]
        self._l0 = [procstat.main_thread_cpu_s(p) for p in self._servers]
        self._b0 = self._backends.cpu()
        self._m0 = procstat.machine_busy_s()

    def stop(self, done: Blast | None = None) -> None:
        """The counters' ends; the machine's where the last client of ``done`` ended."""
        end = procstat.machine_busy_s() if done is None else done.machine_busy_end_s
        self.machine_s = end - self._m0
        self.server_s = sum(procstat.cpu_s(p) for p in self._servers) - sum(self._s0)
        # the main threads: each serving process's event loop (a supervisor's is idle)
        self.loop_s = sum(map(procstat.main_thread_cpu_s, self._servers)) - sum(self._l0)
        b1 = self._backends.cpu()
        self.db_s = sum(cpu - self._b0.get(pid, 0.0) for pid, cpu in b1.items())


# ---------------------------------------------------------------- load


def steps_for(ranks: int, args: argparse.Namespace) -> int:
    return max(int(args.min_steps), math.ceil(int(args.bodies) / ranks))


def prepared(ranks: int, steps: int) -> list[list[bytes]]:
    """``out[step][rank]``: the body of one rank-step, encoded."""
    shape = argparse.Namespace(ranks=ranks, microbatches=MICROBATCHES)
    names = list(spec(METRICS)["metrics"])
    return [bodies(shape, names, range(s, s + 1)) for s in range(steps)]


def register_runs(base: str, ranks: int, clients: int) -> None:
    """The bench's run of ``ranks`` ranks and the clients' warm-up run (one rank each)."""
    run = {"name": RUN, "world_size": ranks, "step_timeout_s": 3600, **spec(METRICS)}
    httpx.post(f"{base}/v1/runs", json=run).raise_for_status()
    warm = {**run, "name": WARM, "world_size": clients}
    httpx.post(f"{base}/v1/runs", json=warm).raise_for_status()


def warm_body(rank: int) -> list[bytes]:
    shape = argparse.Namespace(ranks=rank + 1, microbatches=MICROBATCHES)
    names = list(spec(METRICS)["metrics"])
    return [bodies(shape, names, range(s, s + 1))[rank] for s in range(2)]


def ingest_jobs(
    all_bodies: list[list[bytes]], ports: list[int], clients: int, warm: bool
) -> list[Job]:
    jobs = []
    ranks = len(all_bodies[0])
    for i in range(clients):
        port = ports[i % len(ports)]
        mine = range(i, ranks, clients)
        reqs, tags = [], []
        for step, row in enumerate(all_bodies):
            for r in mine:
                reqs.append(request("POST", port, f"/v1/runs/{RUN}/fragments", row[r]))
                tags.append(step)
        warmup = [request("GET", port, "/healthz")] * 3
        if warm:
            path = f"/v1/runs/{WARM}/fragments"
            warmup += [request("POST", port, path, b) for b in warm_body(i)]
        jobs.append(Job(port, reqs, tags, answers=True, warmup=warmup))
    return jobs


def floor_jobs(ingest: list[Job]) -> list[Job]:
    out = []
    for job in ingest:
        get = request("GET", job.port, "/healthz")
        out.append(Job(job.port, [get] * len(job.requests), warmup=[get] * 3))
    return out


def finalise_ms(
    result: Blast, events: list[tuple[int, str, int, float]], steps: int
) -> tuple[list[float], list[float]]:
    """Per step: event arrival − completing answer, and the completing request's
    round trip (ms)."""
    completing: dict[int, tuple[float, float]] = {}
    last: dict[int, tuple[float, float]] = {}
    for sent in result.sent:
        for i, step in enumerate(sent.steps):
            t = (sent.answered_at[i], sent.answered_at[i] - sent.sent_at[i])
            if step in sent.finalised[i]:
                completing[step] = t
            if step not in last or t[0] > last[step][0]:
                last[step] = t
    first_event: dict[int, float] = {}
    for step, _status, _revision, arrived in events:
        first_event.setdefault(step, arrived)
    missing = [s for s in range(steps) if s not in first_event]
    if missing:
        raise RuntimeError(f"no event for steps {missing[:10]} ({len(missing)} missing)")
    latency, rtt = [], []
    for s in range(steps):
        answered, took = completing.get(s, last[s])
        latency.append((first_event[s] - answered) * 1000)
        rtt.append(took * 1000)
    return latency, rtt


def verify_exact(base: str, all_bodies: list[list[bytes]]) -> int:
    """Every step's values against an independent reference from the bodies sent: each
    sum the exact sum rounded once (``math.fsum``), each count the integer total, each
    extreme the extreme, the derived mean the exact quotient rounded once; bit for bit.
    Raises on the first value that differs; returns the number of steps checked."""
    names = list(spec(METRICS)["metrics"])
    kinds = spec(METRICS)["metrics"]
    with httpx.Client(base_url=base, timeout=60) as http:
        for step, row in enumerate(all_bodies):
            columns: dict[str, list[float]] = {n: [] for n in names}
            for body in row:
                batch = decode_batch(orjson.loads(body))
                m = len(batch.metrics)
                for j, name in enumerate(batch.metrics):
                    columns[name].extend(batch.values[j::m])
            want: dict[str, float] = {}
            for name, values in columns.items():
                kind = kinds[name]
                if kind == "sum":
                    want[name] = math.fsum(values)
                elif kind == "count":
                    want[name] = float(sum(int(v) for v in values))
                else:
                    want[name] = min(values) if kind == "min" else max(values)
            exact = sum(map(Fraction, columns["m00"]), Fraction(0))
            want["mean0"] = float(exact / int(want["m28"]))
            got = http.get(f"/v1/runs/{RUN}/steps/{step}").json()["metrics"]
            for name, value in want.items():
                if got[name]["value"] != value:
                    raise RuntimeError(
                        f"step {step} {name}: served {got[name]['value']!r}, exact {value!r}"
                    )
    return len(all_bodies)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


# ---------------------------------------------------------------- Pushgateway


def push_text(rank: int) -> bytes:
    """One rank-step for the Pushgateway: its 8 × 32 values as gauges by microbatch."""
    lines = []
    for m in range(METRICS):
        lines.append(f"# TYPE m{m:02d} gauge")
        for mb in range(MICROBATCHES):
            lines.append(f'm{m:02d}{{microbatch="{mb}"}} {((rank * 31 + m * 7 + mb) % 997) / 7}')
    return ("\n".join(lines) + "\n").encode()


@contextmanager
def peer(args: list[str], ready: str) -> Iterator[int]:
    """A peer process (``args``), its pid yielded once ``ready`` (a URL) answers 200;
    stopped with SIGTERM (on which the Pushgateway persists its groups) at the end."""
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(ready).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{args[0]} did not start")
            time.sleep(0.05)
        yield proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


@contextmanager
def pushgateway(state: Path, check: bool) -> Iterator[int]:
    port = free_port()
    args = [
        "prometheus-pushgateway",
        f"--web.listen-address=127.0.0.1:{port}",
        f"--persistence.file={state}",
        "--log.level=error",
    ]
    if not check:
        args.append("--push.disable-consistency-check")
    with peer(args, f"http://127.0.0.1:{port}/-/ready"):
        yield port


def pushgateway_rate(ranks: int, args: argparse.Namespace) -> float:
    """Rank-steps/s of the Pushgateway holding ``ranks`` groups (see the docstring)."""
    texts = [push_text(r) for r in range(ranks)]

    def jobs(port: int, rounds: int, deadline: float | None) -> list[Job]:
        out = []
        for i in range(args.clients):
            mine = range(i, ranks, args.clients)
            reqs = [
                request("PUT", port, f"/metrics/job/{RUN}/rank/{r}", texts[r], kind="text")
                for _ in range(rounds)
                for r in mine
            ]
            out.append(Job(port, reqs, deadline_s=deadline))
        return out

    with tempfile.TemporaryDirectory() as d:
        state = Path(d) / "groups"
        with pushgateway(state, check=False) as port:
            fill = blast(jobs(port, 1, None), cpus=args.client_cpus)
            assert not fill.errors, fill.errors[:3]
        with pushgateway(state, check=True) as port:
            timed = blast(
                jobs(port, args.pushgateway_rounds, args.pushgateway_s), cpus=args.client_cpus
            )
            assert not timed.errors, timed.errors[:3]
            assert timed.done > 0
    return float(timed.done / timed.elapsed_s)


# ---------------------------------------------------------------- VictoriaMetrics


def import_text(rank: int, step: int) -> bytes:
    """One rank-step for VictoriaMetrics's Prometheus-text import: the same 8 × 32 values,
    one series per (metric, rank, microbatch), the step as the sample's timestamp."""
    ts = 1_700_000_000_000 + step * 1000
    lines = [
        f'm{m:02d}{{run="{RUN}",rank="{rank}",microbatch="{mb}"}} '
        f"{((rank * 31 + m * 7 + mb + step) % 997) / 7} {ts}"
        for m in range(METRICS)
        for mb in range(MICROBATCHES)
    ]
    return ("\n".join(lines) + "\n").encode()


@contextmanager
def victoria(storage: Path) -> Iterator[tuple[int, int]]:
    """VictoriaMetrics on ``storage``: its port and pid."""
    port = free_port()
    args = [
        "victoria-metrics",
        f"-storageDataPath={storage}",
        f"-httpListenAddr=127.0.0.1:{port}",
        "-retentionPeriod=100y",
        "-loggerLevel=ERROR",
    ]
    with peer(args, f"http://127.0.0.1:{port}/health") as pid:
        yield port, pid


def victoria_jobs(port: int, ranks: int, steps: range, clients: int, stored: bool) -> list[Job]:
    """The rank-steps of ``steps`` for VictoriaMetrics' Prometheus-text import, dealt out
    to the clients as :func:`ingest_jobs` deals Steptally's (each client in step order),
    each client's warm-up writing a series of its own; ``stored``: and every series the
    steps write to, once (step -1, outside the timed range)."""
    path = "/api/v1/import/prometheus"
    jobs = []
    for i in range(clients):
        mine = range(i, ranks, clients)
        reqs = [
            request("POST", port, path, import_text(r, s), kind="text") for s in steps for r in mine
        ]
        warm = [request("POST", port, path, import_text(ranks + i, -1), kind="text")]
        if stored:
            warm += [request("POST", port, path, import_text(r, -1), kind="text") for r in mine]
        jobs.append(Job(port, reqs, warmup=[request("GET", port, "/health")] * 3 + warm))
    return jobs


@dataclass(frozen=True)
class Victoria:
    """VictoriaMetrics beside one row: rank-steps/s, its own HTTP floor (requests/s),
    its CPU per value and the machine's busy share while it imported."""

    rate: float
    floor: float
    cpu_us_per_value: float
    busy_share: float


def victoria_rate(
    ranks: int, steps: int, args: argparse.Namespace, stored: bool = False
) -> Victoria:
    """VictoriaMetrics importing the same rank-steps as the ingest rows, by the same
    clients (ranks dealt out alike, each client in step order), with its CPU over the
    same window as the rows' (from the clients' release to the last answer); and its own
    HTTP floor (``GET /health``, as many, same clients). ``stored``: each client imports
    a step of each of its ranks (step -1, outside the timed range) before the clock, so
    every series the timed steps write to exists already."""
    with tempfile.TemporaryDirectory() as d, victoria(Path(d)) as (port, pid):
        jobs = victoria_jobs(port, ranks, range(steps), args.clients, stored)
        start: dict[str, float] = {}

        def counters() -> None:
            start.update(cpu=procstat.cpu_s(pid), machine=procstat.machine_busy_s())

        timed = blast(jobs, on_start=counters, cpus=args.client_cpus)
        cpu_s = procstat.cpu_s(pid) - start["cpu"]
        machine_s = timed.machine_busy_end_s - start["machine"]
        assert not timed.errors, timed.errors[:3]
        # every value is there: VictoriaMetrics's buffers flushed, then one count
        httpx.get(f"http://127.0.0.1:{port}/internal/force_flush").raise_for_status()
        found = _vm_count(port, ranks, steps)
        assert found == ranks * steps * VALUES_PER_BODY, found
        health = request("GET", port, "/health")
        health_jobs = [Job(port, [health] * len(j.requests), warmup=[health] * 3) for j in jobs]
        floor = blast(health_jobs, cpus=args.client_cpus)
        assert not floor.errors, floor.errors[:3]
    return Victoria(
        rate=float(timed.done / timed.elapsed_s),
        floor=float(floor.done / floor.elapsed_s),
        cpu_us_per_value=1e6 * cpu_s / (timed.done * VALUES_PER_BODY),
        busy_share=machine_s / (timed.elapsed_s * (os.cpu_count() or 1)),
    )


def _vm_count(port: int, ranks: int, steps: int) -> int:
    """Samples of the timed rank-steps that VictoriaMetrics holds (the warm-up's are at
    step -1, before the range)."""
    start = 1_700_000_000_000
    end = start + (steps - 1) * 1000
    params = {"match[]": f'{{run="{RUN}"}}', "start": str(start / 1000), "end": str(end / 1000)}
    deadline = time.monotonic() + 30
    while True:
        body = httpx.get(f"http://127.0.0.1:{port}/api/v1/export", params=params, timeout=60)
        body.raise_for_status()
        n = sum(len(orjson.loads(line)["values"]) for line in body.text.splitlines() if line)
        if n >= ranks * steps * VALUES_PER_BODY or time.monotonic() > deadline:
            return n
        time.sleep(0.5)


# ---------------------------------------------------------------- one row


def measure(
    config: Config,
    ranks: int,
    steps: int,
    pgw: float,
    vm: Victoria,
    vm_stored: Victoria,
    args: argparse.Namespace,
) -> dict[str, Any]:
    all_bodies = prepared(ranks, steps)
    prefix = f"steptally-bench-{uuid.uuid4().hex}" if config.redis else None
    load = os.getloadavg()[0]
    with (
        tempfile.TemporaryDirectory() as logs,
        database(config.db) as url,
        replicas(url, config.replicas, prefix, Path(logs), config.workers, config.cpus) as servers,
    ):
        backends = Backends(url)
        try:
            base = servers[0].base
            register_runs(base, ranks, args.clients)
            ports = [s.port for s in servers]
            jobs = ingest_jobs(all_bodies, ports, args.clients, warm=True)
            window = Window([s.proc.pid for s in servers], backends)
            listener = Listener(base, RUN)
            try:
                result = blast(jobs, on_start=window.start, cpus=args.client_cpus)
                window.stop(result)
                events = listener.wait_for(set(range(steps)), timeout_s=120)
            finally:
                listener.close()
            if result.errors:
                raise RuntimeError(f"{len(result.errors)} errors, first: {result.errors[0]}")
            summary = httpx.get(f"{base}/v1/runs/{RUN}").json()["steps"]
            if summary["complete"] != steps:
                raise RuntimeError(f"{summary} after {steps} steps")
            latency, rtt = finalise_ms(result, events, steps)
            floor_window = Window([s.proc.pid for s in servers], backends)
            floor = blast(floor_jobs(jobs), on_start=floor_window.start, cpus=args.client_cpus)
            floor_window.stop(floor)
            assert not floor.errors, floor.errors[:3]
            rss = max(procstat.peak_rss_mb(p) for s in servers for p in procstat.family(s.proc.pid))
            exact = verify_exact(base, all_bodies)
        finally:
            backends.close()
            if prefix is not None:
                delete_prefix(prefix)
    done = result.done
    values = done * VALUES_PER_BODY
    rate = done / result.elapsed_s
    floor_rate = floor.done / floor.elapsed_s
    return {
        "config": config.name,
        "store": config.db,
        "redis": int(config.redis),
        "replicas": config.replicas,
        "workers": config.workers,
        "cpus": config.cpus or "",
        "ranks": ranks,
        "steps": steps,
        "rank_steps": done,
        "values": values,
        "elapsed_s": result.elapsed_s,
        "rank_steps_per_s": rate,
        "values_per_s": rate * VALUES_PER_BODY,
        "us_per_value": 1e6 / (rate * VALUES_PER_BODY),
        "floor_requests_per_s": floor_rate,
        "floor_ratio": rate / floor_rate,
        "pushgateway_rank_steps_per_s": pgw,
        "pushgateway_ratio": rate / pgw,
        "victoria_rank_steps_per_s": vm.rate,
        "victoria_ratio": rate / vm.rate,
        "victoria_floor_ratio": vm.rate / vm.floor,
        "victoria_cpu_us_per_value": vm.cpu_us_per_value,
        "victoria_busy_share": vm.busy_share,
        "victoria_stored_rank_steps_per_s": vm_stored.rate,
        "victoria_stored_ratio": rate / vm_stored.rate,
        "victoria_stored_cpu_us_per_value": vm_stored.cpu_us_per_value,
        "finalise_p50_ms": pct(latency, 50),
        "finalise_p99_ms": pct(latency, 99),
        "completing_rtt_p50_ms": pct(rtt, 50),
        "completing_rtt_p99_ms": pct(rtt, 99),
        "rtt_p50_ms": pct(
            [
                1000 * (a - b)
                for s in result.sent
                for a, b in zip(s.answered_at, s.sent_at, strict=True)
            ],
            50,
        ),
        "server_cpu_s": window.server_s,
        "db_cpu_s": window.db_s,
        "client_cpu_s": result.cpu_s,
        "machine_cpu_s": window.machine_s,
        "machine_busy_share": window.machine_s / (result.elapsed_s * (os.cpu_count() or 1)),
        "server_cpu_us_per_value": 1e6 * (window.server_s + window.db_s) / values,
        "loop_cpu_us_per_request": 1e6 * window.loop_s / done,
        "loop_busy_share": window.loop_s / (result.elapsed_s * config.replicas * config.workers),
        "client_cpu_us_per_request": 1e6 * result.cpu_s / done,
        "floor_server_cpu_us_per_request": 1e6 * floor_window.server_s / floor.done,
        "floor_client_cpu_us_per_request": 1e6 * floor.cpu_s / floor.done,
        "peak_rss_mb": rss,
        "load_avg_1m": load,
        "steps_exact": exact,
        "client_cpus": args.client_cpus or "",
        **dict.fromkeys(TURNS, ""),
    }


def turns(config: Config, ranks: int, args: argparse.Namespace) -> dict[str, Any]:
    """The row's ``turns_*`` columns: ``scale_paired.py``'s run of ``config`` at ``ranks``
    (a fresh server and database beside a fresh VictoriaMetrics, the same clients sending
    each the same slice of steps in turns, ABBA, ``--turns`` rounds after a warm-up
    round), so that the machine's drift weighs on both alike; a slice is
    ``--turn-bodies`` rank-steps (whole steps, one at least)."""
    import scale_paired  # it imports this module

    if config.redis or config.replicas > 1 or config.workers > 1:
        raise ValueError(f"--turns serves one process on one database, not {config.name}")
    width = max(1, args.turn_bodies // ranks)
    paired = argparse.Namespace(
        db=config.db, ranks=ranks, rounds=args.turns, slice_steps=width,
        clients=args.clients, cpus=config.cpus, client_cpus=args.client_cpus,
    )  # fmt: skip
    t = scale_paired.totals(scale_paired.run(paired))
    return {
        "turns_rounds": args.turns,
        "turns_slice_steps": width,
        "turns_rank_steps_per_s": t["steptally_rate"],
        "turns_victoria_rank_steps_per_s": t["victoria_rate"],
        "turns_ratio": t["ratio"],
        "turns_median_round_ratio": t["median_round_ratio"],
        "turns_rounds_at_1": t["rounds_at_1"],
        "turns_cpu_us_per_value": t["steptally_cpu_us_per_value"],
        "turns_victoria_cpu_us_per_value": t["victoria_cpu_us_per_value"],
    }


# ---------------------------------------------------------------- output


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for row in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paired = [r for r in rows if r["turns_rounds"] != ""]
    fig, axes = plt.subplots(1, 3 if paired else 2, figsize=(24 if paired else 16, 5.2))
    wall, cpu = axes[0], axes[1]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(configs):
        mine = sorted((r for r in rows if r["config"] == name), key=lambda r: r["ranks"])
        x = [r["ranks"] for r in mine]
        c = colours[i % len(colours)]
        wall.plot(x, [r["us_per_value"] for r in mine], "o-", color=c, label=name)
        floor = [1e6 / (r["floor_requests_per_s"] * VALUES_PER_BODY) for r in mine]
        wall.plot(x, floor, ":", color=c, alpha=0.6, label=f"{name}: HTTP floor")
        cpu.plot(x, [r["server_cpu_us_per_value"] for r in mine], "o-", color=c, label=name)
        client = [r["client_cpu_us_per_request"] / VALUES_PER_BODY for r in mine]
        cpu.plot(x, client, "x--", color=c, alpha=0.6, label=f"{name}: client")
    by_ranks = {r["ranks"]: r["pushgateway_rank_steps_per_s"] for r in rows}
    xs = sorted(by_ranks)
    pgw = [1e6 / (by_ranks[x] * VALUES_PER_BODY) for x in xs]
    wall.plot(xs, pgw, "s--", color="black", label="Pushgateway")
    for key, style, label in (
        ("victoria", "D--", "VictoriaMetrics, new series (median of its runs)"),
        ("victoria_stored", "d:", "VictoriaMetrics, series stored (median)"),
    ):
        rates: dict[int, list[float]] = {}
        cpus: dict[int, list[float]] = {}
        for r in rows:
            if f"{key}_rank_steps_per_s" in r:  # CSVs from before the stored series
                rates.setdefault(r["ranks"], []).append(r[f"{key}_rank_steps_per_s"])
                cpus.setdefault(r["ranks"], []).append(r[f"{key}_cpu_us_per_value"])
        at = [x for x in xs if x in rates]
        wall_us = [1e6 / (float(np.median(rates[x])) * VALUES_PER_BODY) for x in at]
        wall.plot(at, wall_us, style, color="grey", label=label)
        cpu.plot(at, [float(np.median(cpus[x])) for x in at], style, color="grey", label=label)
    for ax, title in (
        (wall, "wall time per value (µs), 2 shared cores"),
        (cpu, "CPU per value (µs): server + database, and client"),
    ):
        rank_axes(ax, xs, title)
    if paired:
        turns_plot(axes[2], paired, configs, colours)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def turns_plot(ax: Any, rows: list[dict[str, Any]], configs: list[str], colours: list[str]) -> None:
    """Each configuration's rate over VictoriaMetrics' with its series stored, by ranks:
    in turns (``--turns``) and, for comparison, the row's single measurement beside its
    anchor; 1.0 drawn across."""
    for i, name in enumerate(configs):
        mine = sorted((r for r in rows if r["config"] == name), key=lambda r: r["ranks"])
        if not mine:
            continue
        x = [r["ranks"] for r in mine]
        c = colours[i % len(colours)]
        ax.plot(x, [r["turns_ratio"] for r in mine], "o-", color=c, label=f"{name}: in turns")
        single = [r["victoria_stored_ratio"] for r in mine]
        ax.plot(x, single, "x:", color=c, alpha=0.6, label=f"{name}: the row, timed once")
    ax.axhline(1.0, color="black", linewidth=0.8)
    rounds = rows[0]["turns_rounds"]
    title = f"× VictoriaMetrics, series stored ({rounds} rounds in turns)"
    rank_axes(ax, sorted({r["ranks"] for r in rows}), title)
    ax.set_yscale("linear")  # ratios near 1: a linear axis labels them all


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as the table of bench/README.md, Scale."""
    out = [
        "| config | ranks × steps | rank-steps/s | values/s | µs/value | × HTTP floor "
        "| × Pushgateway | × VictoriaMetrics (its rank-steps/s) "
        "| × VictoriaMetrics, series stored (its rank-steps/s) | finalise p50 / p99 ms "
        "| completing request p50 / p99 ms (median request) | server + db CPU µs/value "
        "| VictoriaMetrics CPU µs/value | client CPU µs/request | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['config']} | {r['ranks']} × {r['steps']} | {r['rank_steps_per_s']:.0f} "
            f"| {r['values_per_s'] / 1000:.0f}k | {r['us_per_value']:.1f} "
            f"| {r['floor_ratio']:.3f} | {r['pushgateway_ratio']:.1f} "
            f"| {r['victoria_ratio']:.2f} ({r['victoria_rank_steps_per_s']:.0f}) "
            f"| {r['victoria_stored_ratio']:.2f} ({r['victoria_stored_rank_steps_per_s']:.0f}) "
            f"| {r['finalise_p50_ms']:.1f} / {r['finalise_p99_ms']:.1f} "
            f"| {r['completing_rtt_p50_ms']:.0f} / {r['completing_rtt_p99_ms']:.0f} "
            f"({r['rtt_p50_ms']:.0f}) | {r['server_cpu_us_per_value']:.1f} "
            f"| {r['victoria_cpu_us_per_value']:.1f} "
            f"| {r['client_cpu_us_per_request']:.0f} | {r['peak_rss_mb']:.0f} |"
        )
    paired = [r for r in rows if r["turns_rounds"] != ""]
    if paired:
        out += [
            "",
            "In turns with VictoriaMetrics, its series stored (`--turns`: the same clients, "
            "the same slices of steps, ABBA, a warm-up round left out):",
            "",
            "| config | ranks | rounds × steps a slice | rank-steps/s | VictoriaMetrics' "
            "| **× VictoriaMetrics** | median round | rounds ≥ 1.0 "
            "| CPU µs a value (VictoriaMetrics') |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in paired:
            out.append(
                f"| {r['config']} | {r['ranks']} | {r['turns_rounds']} × "
                f"{r['turns_slice_steps']} | {r['turns_rank_steps_per_s']:.0f} "
                f"| {r['turns_victoria_rank_steps_per_s']:.0f} | **{r['turns_ratio']:.2f}** "
                f"| {r['turns_median_round_ratio']:.2f} "
                f"| {r['turns_rounds_at_1']} of {r['turns_rounds']} "
                f"| {r['turns_cpu_us_per_value']:.2f} "
                f"({r['turns_victoria_cpu_us_per_value']:.2f}) |"
            )
    return "\n".join(out)


def progress(row: dict[str, Any]) -> None:
    log(
        f"{row['config']:>17} {row['ranks']:>5} ranks × {row['steps']:>3} steps: "
        f"{row['rank_steps_per_s']:7.1f} rank-steps/s ({row['values_per_s']:,.0f} values/s), "
        f"{row['floor_ratio']:.2f} of the HTTP floor, {row['pushgateway_ratio']:.1f}× the "
        f"Pushgateway, {row['victoria_ratio']:.2f}× VictoriaMetrics "
        f"({row['victoria_stored_ratio']:.2f}× with its series stored), finalise p50/p99 "
        f"{row['finalise_p50_ms']:.1f}/"
        f"{row['finalise_p99_ms']:.1f} ms, server {row['server_cpu_s']:.1f} s + db "
        f"{row['db_cpu_s']:.1f} s vs client {row['client_cpu_s']:.1f} s CPU "
        f"({row['server_cpu_us_per_value']:.1f} µs/value against VictoriaMetrics' "
        f"{row['victoria_cpu_us_per_value']:.1f}), event loop "
        f"{row['loop_cpu_us_per_request']:.0f} µs/request ({100 * row['loop_busy_share']:.0f} % "
        f"busy), machine {100 * row['machine_busy_share']:.0f} % busy, RSS "
        f"{row['peak_rss_mb']:.0f} MB"
    )
    if row["turns_rounds"] != "":
        log(
            f"{row['config']:>17} {row['ranks']:>5} ranks in turns: "
            f"{row['turns_rank_steps_per_s']:7.1f} rank-steps/s, "
            f"{row['turns_ratio']:.2f}× VictoriaMetrics with its series stored "
            f"({row['turns_rounds_at_1']} of {row['turns_rounds']} rounds ≥ 1.0), "
            f"{row['turns_cpu_us_per_value']:.2f} µs CPU a value against "
            f"{row['turns_victoria_cpu_us_per_value']:.2f}"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512, 4096])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--clients", type=int, default=8, help="client processes")
    p.add_argument(
        "--bodies", type=int, default=1024, help="rank-steps per row at least (more steps)"
    )
    p.add_argument("--min-steps", type=int, default=6, help="steps per row at least")
    p.add_argument(
        "--workers", type=int, nargs="+", default=[1], help="steptally serve --workers, each"
    )
    p.add_argument(
        "--cpus",
        nargs="+",
        default=["-"],
        help="steptally serve --cpus, each (a Linux CPU list; -: unset), e.g. - 1",
    )
    p.add_argument("--pushgateway-s", type=float, default=5.0, help="time box of its pushes")
    p.add_argument("--pushgateway-rounds", type=int, default=4, help="pushes of each rank")
    p.add_argument(
        "--client-cpus",
        default=None,
        help="the client processes' cores, e.g. 0 (unset: where the kernel puts them)",
    )
    p.add_argument(
        "--turns",
        type=int,
        default=0,
        help="after each row, its server and VictoriaMetrics (series stored) in turns for "
        "this many rounds (scale_paired.py; 0: not)",
    )
    p.add_argument(
        "--turn-bodies", type=int, default=2048, help="rank-steps a slice of --turns, about"
    )
    p.add_argument("--quick", action="store_true", help="8 and 64 ranks, SQLite, few steps")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    if args.quick:
        args.ranks, args.configs = [8, 64], ["sqlite"]
        args.bodies, args.min_steps, args.pushgateway_s = 128, 2, 2.0
    stem = "scale_quick" if args.quick else "scale"
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for ranks in args.ranks:
        steps = steps_for(ranks, args)
        pgw = pushgateway_rate(ranks, args)
        log(f"{'Pushgateway':>17} {ranks:>5} ranks: {pgw:7.1f} rank-steps/s")
        for name in args.configs:
            for workers, cpus in ((w, c) for w in args.workers for c in args.cpus):
                vm = victoria_rate(ranks, steps, args)  # beside each row: the load drifts
                vm_stored = victoria_rate(ranks, steps, args, stored=True)
                for label, v in (("new series", vm), ("stored series", vm_stored)):
                    log(
                        f"{'VictoriaMetrics':>17} {ranks:>5} ranks: {v.rate:7.1f} rank-steps/s "
                        f"({label}; {v.rate / v.floor:.2f} of its HTTP floor), "
                        f"{v.cpu_us_per_value:.1f} µs CPU/value, machine "
                        f"{100 * v.busy_share:.0f} % busy"
                    )
                config = CONFIGS[name].serving(workers, None if cpus == "-" else cpus)
                row = measure(config, ranks, steps, pgw, vm, vm_stored, args)
                if args.turns:
                    row.update(turns(config, ranks, args))
                rows.append(row)
                progress(row)
                write_csv(rows, args.out / f"{stem}.csv")
    plot(rows, args.out / f"{stem}.png")
    print(markdown(rows))
    log(f"wrote {args.out / stem}.csv and .png in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
