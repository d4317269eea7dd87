"""Two replicas of ``steptally serve`` on one database; one is killed with SIGKILL in the
middle of a run while its clients retry on the other. Nothing acknowledged is lost,
every step is finalised once (revision 1) and its values are the exact ones."""

from __future__ import annotations

import random
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import httpx
from support.served import ServedService

RANKS, STEPS = 4, 24
SPEC = {"name": "k", "world_size": RANKS, "metrics": {"a": "sum", "n": "count"}}


def _value(step: int, rank: int) -> float:
    # large values that cancel: any rounding along the way would show
    return (1e17, 0.1, -1e17, float(step))[rank] * (1 + step % 3)


def _body(step: int, rank: int) -> dict[str, object]:
    fragment = {"step": step, "rank": rank, "seq": 0, "values": {"a": _value(step, rank), "n": 1}}
    return {"fragments": [fragment], "commits": [{"step": step, "rank": rank, "fragments": 1}]}


def test_a_replica_killed_mid_run_loses_nothing_acknowledged(
    db_url: str, serve: Callable[..., ServedService]
) -> None:
    a, b = serve(db_url), serve(db_url)
    assert httpx.post(f"{a.url}/v1/runs", json=SPEC).status_code == 201
    jobs = [(s, r) for s in range(STEPS) for r in range(RANKS)]
    random.Random(3).shuffle(jobs)
    acked: list[tuple[int, int]] = []
    served = {a.url: 0, b.url: 0}
    lock = threading.Lock()
    killed = threading.Event()

    def post(job: tuple[int, int], index: int) -> None:
        step, rank = job
        first = a if index % 2 == 0 and not killed.is_set() else b
        for target in (first, b, b, b):  # a client retries on the other replica
            try:
                answer = httpx.post(f"{target.url}/v1/runs/k/fragments", json=_body(step, rank))
            except httpx.TransportError:
                continue
            assert answer.status_code == 200, answer.text
            with lock:
                acked.append(job)
                served[target.url] += 1
            return

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(post, job, i) for i, job in enumerate(jobs)]
        for i, future in enumerate(futures):
            if i == len(futures) // 2:
                a.stop(signal.SIGKILL)  # mid-run, with requests in flight
                killed.set()
            future.result()
    assert sorted(acked) == sorted(jobs)
    assert served[a.url] > 0 and served[b.url] > 0  # both replicas took part
    with httpx.Client(base_url=b.url) as http:
        steps = http.get("/v1/runs/k/steps", params={"limit": 1000}).json()["steps"]
    assert [s["step"] for s in steps] == list(range(STEPS))
    for s in steps:
        exact = sum(Fraction(_value(s["step"], r)) for r in range(RANKS))
        assert (s["status"], s["revision"]) == ("complete", 1), s
        assert s["metrics"]["a"]["value"] == float(exact)
        assert s["metrics"]["n"]["value"] == RANKS
        assert s["fragments"] == {"received": RANKS, "expected": RANKS}
