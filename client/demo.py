"""A simulated GRPO run that pushes real loss fragments, for a first look.

``run_demo`` plays ``ranks`` training ranks, each a thread with its own
:class:`~steptally.client.reporter.Reporter`. Every step each rank computes the clipped
policy-gradient loss (:mod:`steptally.client.loss`) on an uneven number of synthetic
microbatches with ``-inf`` positions on both sides, logs the fragments and commits.
The policy drifts over the run, so the diagnostics move. Every ``late_every``-th step
one rank commits after the step timeout: the step is finalised *partial* first,
naming the missing rank, then again, complete, when the rank arrives.

A watcher prints one line per finalisation, so a person sees the run progress.
"""

from __future__ import annotations

import math
import random
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

SHOWN = ("probs_ratio", "probs_ratio_max", "kl_penalty", "approx_entropy", "token_mult_prob_error")


@dataclass(frozen=True)
class DemoPlan:
    run: str = "demo-grpo"
    ranks: int = 8
    steps: int = 30
    step_interval_s: float = 0.5
    step_timeout_s: float = 2.0
    late_every: int = 7
    late_by_s: float = 3.0  # past the timeout: the service sweeps overdue steps each second
    seed: int = 0
    # a burst of -inf filtering on every rank: the default filtered_token_share rule breaks
    burst_step: int | None = 11


def _microbatches(plan: DemoPlan, step: int, rank: int) -> list[Any]:
    from steptally.client.loss.synthetic import synthetic_microbatch

    rnd = random.Random(plan.seed * 1_000_003 + step * 1009 + rank)
    drift = 0.5 + 0.5 * math.sin(step / 6.0)  # filtering comes and goes over the run
    burst = 0.12 if step == plan.burst_step else 0.0
    return [
        synthetic_microbatch(
            rnd.randrange(1 << 30),
            sequences=rnd.randint(2, 6),
            max_len=rnd.choice((32, 48, 64, 96)),
            curr_filtered=0.01 + 0.04 * drift + burst,
            prev_filtered=0.005 + 0.02 * drift,
        )
        for _ in range(rnd.randint(1, 4))  # uneven microbatches per rank
    ]


def _step_batches(plan: DemoPlan, step: int) -> list[list[Any]]:
    """Every rank's microbatches with the step's global normalisers (what an all-reduce
    of the token and sequence counts gives a real trainer)."""
    from steptally.client.loss.synthetic import with_global_normalisers

    per_rank = [_microbatches(plan, step, rank) for rank in range(plan.ranks)]
    flat = with_global_normalisers([b for batches in per_rank for b in batches])
    out, start = [], 0
    for batches in per_rank:
        out.append(flat[start : start + len(batches)])
        start += len(batches)
    return out


def _rank(
    plan: DemoPlan,
    url: str,
    rank: int,
    batches: Callable[[int], list[Any]],
    barrier: threading.Barrier,
    spool: Path,
) -> None:
    from steptally.client.loss import ClippedPGLoss
    from steptally.client.reporter import Reporter

    loss_fn = ClippedPGLoss()
    delayed: list[threading.Timer] = []
    with Reporter(
        url,
        run=plan.run,
        spec=loss_fn.metric_spec(),
        rank=rank,
        world_size=plan.ranks,
        step_timeout_s=plan.step_timeout_s,
        spool_dir=spool / f"rank{rank}",
    ) as reporter:

        def report(step: int, fragments: list[Any]) -> None:
            for f in fragments:
                reporter.log(step, f)
            reporter.commit(step)

        for step in range(plan.steps):
            fragments = []
            for batch in batches(step):
                loss, f = loss_fn(batch)
                loss.backward()  # type: ignore[no-untyped-call]
                fragments.append(f)
            late = plan.late_every and step % plan.late_every == plan.late_every - 1
            if late and rank == plan.ranks - 1:  # this rank's report arrives after the timeout
                timer = threading.Timer(
                    plan.step_timeout_s + plan.late_by_s, report, (step, fragments)
                )
                timer.start()
                delayed.append(timer)
            else:
                report(step, fragments)
            barrier.wait()  # the gradient all-reduce keeps the ranks in step
            time.sleep(plan.step_interval_s)
        for timer in delayed:
            timer.join()


def _describe(step: dict[str, Any]) -> str:
    m = step["metrics"]

    def fmt(name: str) -> str:
        value = m.get(name, {}).get("value")
        return f"{name}={value:.5g}" if isinstance(value, float) else f"{name}={value}"

    ranks = f"{len(step['ranks_committed'])}/{step['world_size']} ranks"
    head = f"step {step['step']:>3}  {step['status']:<8} rev {step['revision']}  {ranks}"
    if step["ranks_missing"]:
        head += f"  missing {step['ranks_missing']}"
    filtered = (
        f"filtered curr/prev={m['filtered_curr_tokens']['value']:.0f}/"
        f"{m['filtered_prev_tokens']['value']:.0f}"
    )
    return f"{head}  {'  '.join(fmt(n) for n in SHOWN)}  {filtered}"


def _watch(plan: DemoPlan, url: str, stop: threading.Event, echo: Callable[[str], None]) -> None:
    seen: dict[int, int] = {}
    with httpx.Client(base_url=url, timeout=10) as client:
        while not stop.wait(0.3):
            answer = client.get(f"/v1/runs/{plan.run}/steps", params={"limit": 1000})
            if answer.status_code != 200:
                continue
            for step in answer.json()["steps"]:
                if step["status"] != "open" and seen.get(step["step"]) != step["revision"]:
                    seen[step["step"]] = step["revision"]
                    echo(_describe(step))


def run_demo(url: str, plan: DemoPlan, echo: Callable[[str], None] = print) -> None:
    """Play the run against the service at ``url``; returns when every rank is done."""
    cache: dict[int, list[list[Any]]] = {}
    lock = threading.Lock()

    def batches_of(rank: int) -> Callable[[int], list[Any]]:
        def get(step: int) -> list[Any]:
            with lock:
                if step not in cache:
                    cache[step] = _step_batches(plan, step)
                return cache[step][rank]

        return get

    echo(f"demo: {plan.ranks} ranks, {plan.steps} steps, run {plan.run!r} at {url}")
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(plan, url, stop, echo), daemon=True)
    watcher.start()
    with tempfile.TemporaryDirectory(prefix="steptally-demo-") as spool:
        barrier = threading.Barrier(plan.ranks)
        threads = [
            threading.Thread(target=_rank, args=(plan, url, r, batches_of(r), barrier, Path(spool)))
            for r in range(plan.ranks)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    time.sleep(1.5)  # let the watcher print the last finalisations
    stop.set()
    watcher.join()
    echo(f"demo: done; every step is at {url}/v1/runs/{plan.run}/steps")


__all__ = ["DemoPlan", "run_demo"]
