"""The real reporter against the real service, started as a subprocess.

Eight spawned processes act as ranks with uneven microbatches. The service is killed
with SIGKILL mid-run and restarted on the same SQLite file; while it is away the ranks
keep logging into their spools, and one rank process exits and is replaced by a new
process that replays its spool. Every step must end complete, with each metric
bit-identical to the exact single-pass reference, and no fragment counted twice.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import runpy
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.served import ServedService

from steptally.client.algebra import MetricSpec, combine

pytestmark = pytest.mark.slow

RANK_SCRIPT = Path(__file__).with_name("reporter_rank.py")
RANK = runpy.run_path(str(RANK_SCRIPT))  # SPEC and fragments_for, for the reference
WORLD = 8
STEPS = {"A": (0, 4), "B": (4, 8), "C": (8, 12)}


@pytest.fixture
def service(tmp_path: Path) -> Iterator[ServedService]:
    """``steptally serve`` on a fixed port and SQLite file, to kill and start again."""
    svc = ServedService(f"sqlite:///{tmp_path / 'steptally.sqlite3'}", tmp_path / "service.log")
    svc.start()
    try:
        yield svc
    finally:
        svc.stop()


def _start_rank(ctx: Any, cfg: dict[str, Any], events: dict[str, Any], results: Any) -> Any:
    init = {"CFG": cfg, "EVENTS": events, "RESULTS": results}
    proc = ctx.Process(
        target=runpy.run_path,
        args=(str(RANK_SCRIPT),),
        kwargs={"init_globals": init, "run_name": "__main__"},
        name=f"rank-{cfg['rank']}",
    )
    proc.start()
    return proc


class Inbox:
    """Messages from the rank processes, kept until the test asks for them."""

    def __init__(self, results: Any) -> None:
        self.results = results
        self.seen: list[tuple[str, int, str, dict[str, Any]]] = []

    def wait(self, kind: str, phase: str, count: int) -> dict[int, dict[str, Any]]:
        deadline = time.monotonic() + 90
        while True:
            got = {r: s for k, r, ph, s in self.seen if (k, ph) == (kind, phase)}
            if len(got) >= count:
                return got
            try:
                self.seen.append(self.results.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                raise TimeoutError(f"only ranks {sorted(got)} sent {kind} {phase}") from None


def test_eight_ranks_survive_a_killed_service_and_a_replaced_rank(
    service: ServedService, tmp_path: Path
) -> None:
    ctx = multiprocessing.get_context("spawn")
    events = {"B": ctx.Event(), "C": ctx.Event()}
    results = ctx.Queue()
    inbox = Inbox(results)
    base = {"url": service.url, "run": "e2e", "world_size": WORLD, "steps": STEPS}
    cfgs = [
        {**base, "rank": r, "spool": str(tmp_path / f"spool-{r}"), "phases": ["A", "B", "C"]}
        for r in range(WORLD)
    ]
    cfgs[-1].update(phases=["A", "B"], leave_spool=True)  # the rank that will be replaced
    procs = [_start_rank(ctx, cfg, events, results) for cfg in cfgs]
    try:
        inbox.wait("done", "A", WORLD)
        service.stop(signal.SIGKILL)  # mid-run: batches of phase A may still be on their way
        events["B"].set()
        during = inbox.wait("done", "B", WORLD)
        inbox.wait("stats", "B", 1)
        procs[-1].join(60)
        spool = tmp_path / f"spool-{WORLD - 1}"
        assert list(spool.glob("*.json*")), "the departing rank left no spool"
        service.start()  # the same SQLite file
        replacement = {**cfgs[-1], "phases": ["C"], "leave_spool": False}
        procs.append(_start_rank(ctx, replacement, events, results))
        events["C"].set()
        final = inbox.wait("stats", "C", WORLD)
        for proc in procs:
            proc.join(60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    assert len(during) == WORLD  # every rank kept logging while the service was down ...
    assert all(final[r]["spooled"] > 0 for r in range(WORLD - 1))  # ... into its spool
    assert all(stats["queued"] == 0 and stats["dropped"] == 0 for stats in final.values())
    assert all(stats["rejected"] == 0 for stats in final.values()), final
    assert not list((tmp_path / f"spool-{WORLD - 1}").glob("*.json*"))  # replayed
    _check_every_step(service.url)


def _check_every_step(url: str) -> None:
    spec = MetricSpec.from_json(RANK["SPEC"])
    with httpx.Client(base_url=url, timeout=30) as client:
        for step in range(STEPS["C"][1]):
            fragments = [f for r in range(WORLD) for f in RANK["fragments_for"](r, step)]
            got = client.get(f"/v1/runs/e2e/steps/{step}").json()
            assert got["status"] == "complete", got
            assert got["ranks_missing"] == [] and got["missing_fragments"] == {}
            assert got["fragments"] == {"received": len(fragments), "expected": len(fragments)}
            reference = combine(spec, fragments)
            for name, result in reference.items():
                metric = got["metrics"][name]
                assert result.value is not None
                assert metric["value"] == result.value, (step, name)  # bit-identical
                assert metric["value"].hex() == result.value.hex()
                if name in spec.metrics:
                    assert metric["values"] == len(fragments)  # nothing counted twice
        run = client.get("/v1/runs/e2e").json()
    assert run["steps"]["complete"] == STEPS["C"][1] and run["steps"]["partial"] == 0
    assert os.path.exists(RANK_SCRIPT)
