"""Steps: complete in any order, partial after the timeout, late data re-finalises."""

from __future__ import annotations

import itertools
import random
import time
from fractions import Fraction
from typing import Any

Api = Any  # the `api` fixture of conftest.py


def _pieces() -> list[dict[str, Any]]:
    """One step of 3 ranks cut into single-item batches: fragments and commits."""
    values = {0: [1e17, 2.0], 1: [-1e17], 2: [0.5, 0.25, 3.0]}
    out: list[dict[str, Any]] = []
    for rank, vs in values.items():
        for seq, v in enumerate(vs):
            out.append(
                {"fragments": [{"step": 0, "rank": rank, "seq": seq, "values": {"a": v, "n": 1}}]}
            )
        out.append({"commits": [{"step": 0, "rank": rank, "fragments": len(vs)}]})
    return out


def test_complete_in_any_order(api: Api) -> None:
    pieces = _pieces()
    orders = [list(range(len(pieces))), list(reversed(range(len(pieces))))]
    rnd = random.Random(3)
    orders += [rnd.sample(range(len(pieces)), len(pieces)) for _ in range(3)]
    for n, order in enumerate(orders):
        run = f"r{n}"
        api.register(name=run, world_size=3)
        for i, index in enumerate(order):
            body = api.client.post(f"/v1/runs/{run}/fragments", json=pieces[index]).json()
            last = i == len(order) - 1
            assert body["finalised"] == (
                [{"step": 0, "status": "complete", "revision": 1}] if last else []
            ), (order, i)
        step = api.step(0, run)
        assert (step["status"], step["revision"]) == ("complete", 1)
        assert step["metrics"]["a"]["value"] == 5.75
        assert step["fragments"] == {"received": 6, "expected": 6}


def test_open_step_shows_progress_and_metrics_so_far(api: Api) -> None:
    api.register(world_size=3)
    api.send([(0, 0, 0, {"a": 1.5, "n": 2}), (0, 1, 0, {"a": 1.0, "n": 1})], [(0, 1, 3)])
    step = api.step(0)
    assert (step["status"], step["revision"], step["finalised_at"]) == ("open", 0, None)
    assert step["ranks_committed"] == [1]
    assert step["ranks_missing"] == [0, 2]
    assert step["fragments"] == {"received": 2, "expected": None}
    assert step["missing_fragments"] == {"1": 2}
    assert step["metrics"]["a"]["value"] == 2.5


def test_partial_after_timeout_names_what_is_missing(api: Api, app: Any, clock: Any) -> None:
    api.register(world_size=3, step_timeout_s=30)
    api.send([(0, 0, 0, {"a": 1.0, "n": 1}), (0, 1, 0, {"a": 2.0, "n": 1})], [(0, 1, 2)])
    clock.now += 29
    assert app.state.service.sweep() == []
    clock.now += 1
    done = app.state.service.sweep()
    assert [(d.step, d.status.value, d.revision) for d in done] == [(0, "partial", 1)]
    step = api.step(0)
    assert (step["status"], step["revision"]) == ("partial", 1)
    assert step["ranks_missing"] == [0, 2]
    assert step["missing_fragments"] == {"1": 1}
    assert step["metrics"]["a"]["value"] == 3.0
    assert app.state.service.sweep() == []  # finalised once


def test_late_fragment_refinalises_with_next_revision(api: Api, app: Any, clock: Any) -> None:
    api.register(world_size=2, step_timeout_s=10)
    api.send([(0, 0, 0, {"a": 1.0, "n": 1})], [(0, 0, 1)])
    clock.now += 10
    app.state.service.sweep()
    late = api.send([(0, 1, 0, {"a": 2.0, "n": 1})]).json()
    assert late["finalised"] == [{"step": 0, "status": "partial", "revision": 2}]
    assert api.step(0)["ranks_missing"] == [1]
    assert api.value(0, "a") == 3.0
    done = api.send([], [(0, 1, 1)]).json()
    assert done["finalised"] == [{"step": 0, "status": "complete", "revision": 3}]
    step = api.step(0)
    assert (step["status"], step["ranks_missing"], step["missing_fragments"]) == (
        "complete",
        [],
        {},
    )
    assert api.send([(0, 1, 0, {"a": 2.0, "n": 1})]).json()["duplicates"] == 1
    assert api.send([(0, 1, 1, {"a": 2.0})]).status_code == 409


def test_background_sweeper_finalises_overdue_steps(
    make_client: Any, api_of: Any, clock: Any
) -> None:
    _, client = make_client(sweep=True, sweep_interval_s=0.05)
    api = api_of(client)
    api.register(step_timeout_s=5)
    api.send([(0, 0, 0, {"a": 1.0})])
    clock.now += 5
    deadline = time.monotonic() + 10
    while api.step(0)["status"] == "open":
        assert time.monotonic() < deadline, "the sweeper never finalised the step"
        time.sleep(0.02)
    assert api.step(0)["status"] == "partial"


def test_pages_of_steps_and_series(api: Api) -> None:
    api.register(world_size=1, derived={"mean": "a / n"})
    for step in range(5):
        api.send([(step, 0, 0, {"a": float(step), "n": 2})], [(step, 0, 1)] if step < 4 else [])
    seen, cursor = [], None
    for _ in range(5):
        params: dict[str, Any] = {"limit": 2, "metric": ["mean"], "start": 1}
        if cursor:
            params["cursor"] = cursor
        page = api.client.get("/v1/runs/r/steps", params=params).json()
        seen += [(s["step"], s["status"], list(s["metrics"])) for s in page["steps"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [
        (1, "complete", ["mean"]),
        (2, "complete", ["mean"]),
        (3, "complete", ["mean"]),
        (4, "open", ["mean"]),
    ]
    series = api.client.get("/v1/runs/r/series/mean", params={"end": 4}).json()
    assert series == {  # finalised steps only: the open step 4 is not in the series
        "metric": "mean",
        "kind": "derived",
        "total": 4,
        "downsampled": False,
        "steps": [0, 1, 2, 3],
        "values": [0.0, 0.5, 1.0, 1.5],
        "status": ["complete"] * 4,
        "revision": [1] * 4,
        "breaches": [],  # the run has no alert rules
    }
    assert api.client.get("/v1/runs/r/series/zz").json()["error"]["code"] == "metric_not_found"
    assert api.client.get("/v1/runs/r/steps/9").json()["error"]["code"] == "unknown_step"


def test_metric_added_later_extends_new_steps(api: Api) -> None:
    api.register(world_size=1, metrics={"a": "sum"})
    api.send([(0, 0, 0, {"a": 1.0})], [(0, 0, 1)])
    api.register(world_size=1, metrics={"a": "sum", "b": "max"})
    api.send([(1, 0, 0, {"a": 1.0, "b": 4.0})], [(1, 0, 1)])
    assert api.step(0)["metrics"]["b"]["value"] is None
    assert api.value(1, "b") == 4.0
    assert api.send([(0, 0, 0, {"a": 1.0})]).json()["duplicates"] == 1


def test_every_ordering_of_two_ranks(api: Api) -> None:
    items = [("f", 0, 0), ("f", 0, 1), ("c", 0, 2), ("f", 1, 0), ("c", 1, 1)]
    for n, order in enumerate(itertools.permutations(items)):
        if n % 7:
            continue  # a spread of the 120 orders keeps the test quick
        run = f"p{n}"
        api.register(name=run)
        for kind, rank, x in order:
            if kind == "f":
                body = api.send([(0, rank, x, {"a": 0.1 * (rank + x + 1)})], run=run).json()
            else:
                body = api.send([], [(0, rank, x)], run=run).json()
        assert body["finalised"] == [{"step": 0, "status": "complete", "revision": 1}]
        exact = sum(Fraction(0.1 * k) for k in (1, 2, 2))
        assert api.value(0, "a", run) == float(exact)


def test_ranks_late_names_ranks_committed_after_a_partial_finalisation(
    api: Api, app: Any, clock: Any
) -> None:
    api.register(world_size=3, step_timeout_s=10)
    api.send([(0, 0, 0, {"a": 1.0, "n": 1})], [(0, 0, 1)])
    api.send([(1, r, 0, {"a": 1.0, "n": 1}) for r in range(3)], [(1, r, 1) for r in range(3)])
    assert api.step(0)["ranks_late"] == []  # open
    clock.now += 10
    app.state.service.sweep()
    assert (api.step(0)["status"], api.step(0)["ranks_late"]) == ("partial", [])
    api.send([(0, 1, 0, {"a": 2.0, "n": 1})])  # a late fragment, not yet a commit
    assert (api.step(0)["revision"], api.step(0)["ranks_late"]) == (2, [])
    api.send([], [(0, 1, 1)])
    assert (api.step(0)["revision"], api.step(0)["ranks_late"]) == (3, [1])
    api.send([(0, 2, 0, {"a": 4.0, "n": 1})], [(0, 2, 1)])
    step = api.step(0)
    assert (step["status"], step["revision"], step["ranks_late"]) == ("complete", 4, [1, 2])
    assert api.step(1)["ranks_late"] == []  # complete on time
