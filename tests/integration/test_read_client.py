"""The notebook client (``steptally.client.read``) against a real ``steptally serve``, on
both databases: every finalised step across pages, values bit for bit, undefined values
with their reasons, the three formats, back-off on 429, errors, and a live follower
that misses nothing across a restart of the service."""

from __future__ import annotations

import math
import queue
import signal
import threading
import time
from fractions import Fraction
from typing import Any

import httpx
import polars as pl
import pytest

from steptally.client.read import Client, ReadError
from tests.support.served import ServedService

STEPS = 2_345  # three pages of the service's 1,000
PARTIAL = [STEPS, STEPS + 1]  # rank 1 never commits these: partial after the timeout
TIMEOUT_S = 4.0
SPEC = {
    "world_size": 2,
    "metrics": {"a": "sum", "n": "count", "hi": "max"},
    "derived": {"mean": "a / n"},
    "step_timeout_s": TIMEOUT_S,
}


def _a(step: int, rank: int) -> float | str:
    if step == 7:
        return "NaN"
    if step == 8 and rank == 0:
        return "Infinity"
    return 1e16 * (step + 1) if rank == 0 else 1.0 + step / 7


def _values(step: int, rank: int) -> dict[str, Any]:
    values: dict[str, Any] = {"a": _a(step, rank), "n": 0 if step == 9 else 1}
    if step != 10:
        values["hi"] = float(step * 2 + rank)
    return values


def _body(steps: list[int], rank: int, commit: bool = True) -> dict[str, Any]:
    return {
        "fragments": [
            {"step": s, "rank": rank, "seq": 0, "values": _values(s, rank)} for s in steps
        ],
        "commits": [{"step": s, "rank": rank, "fragments": 1} for s in steps] if commit else [],
    }


def _post(url: str, run: str, body: dict[str, Any]) -> Any:
    answer = httpx.post(f"{url}/v1/runs/{run}/fragments", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _expected(step: int) -> dict[str, float | None]:
    """The exact step values, each rounded once, from the fragments' definitions."""
    ranks = (0,) if step == PARTIAL[1] else (0, 1)
    if step == 7:
        return {"a": math.nan, "n": 2.0, "hi": 15.0, "mean": math.nan}
    if step == 8:
        return {"a": math.inf, "n": 2.0, "hi": 17.0, "mean": math.inf}
    a = sum(Fraction(_a(step, r)) for r in ranks)  # type: ignore[arg-type]
    n = 0 if step == 9 else len(ranks)
    return {
        "a": float(a),
        "n": float(n),
        "hi": None if step == 10 else float(step * 2 + ranks[-1]),
        "mean": None if n == 0 else float(a / n),
    }


def _same(got: Any, want: float | None) -> bool:
    if want is None:
        return got is None
    if math.isnan(want):
        return isinstance(got, float) and math.isnan(got)
    return isinstance(got, float) and got == want


def _filled(url: str) -> None:
    """Run ``r``: STEPS complete steps, two partial ones (one of them revised to
    complete by a late commit), and one open step."""
    assert httpx.post(f"{url}/v1/runs", json={"name": "r", **SPEC}).status_code == 201
    _post(url, "r", _body([*range(STEPS), *PARTIAL], 0))
    _post(url, "r", _body(list(range(STEPS)), 1))
    deadline = time.monotonic() + TIMEOUT_S + 10
    while httpx.get(f"{url}/v1/runs/r/steps/{PARTIAL[1]}").json()["status"] != "partial":
        assert time.monotonic() < deadline, "the sweeper never finalised the partial steps"
        time.sleep(0.1)
    revised = _post(url, "r", _body([PARTIAL[0]], 1))["finalised"]
    assert revised == [{"step": PARTIAL[0], "status": "complete", "revision": 2}]
    _post(url, "r", _body([STEPS + 5], 0, commit=False))  # open for TIMEOUT_S


def test_every_finalised_step_with_exact_values_in_three_formats(served: ServedService) -> None:
    _filled(served.url)
    with Client(served.url) as client:
        run = client.run("r")
        assert run.metrics == ["a", "n", "hi", "mean"]
        rows = run.steps(format="records")
        undefined = run.undefined()
        frame = run.steps()
        polars = run.steps(format="polars")
    assert [r["step"] for r in rows] == [*range(STEPS), *PARTIAL]  # not the open step
    for row in rows:
        want = _expected(row["step"])
        assert all(_same(row[m], want[m]) for m in want), (row, want)
    by_step = {r["step"]: r for r in rows}
    assert (by_step[PARTIAL[0]]["status"], by_step[PARTIAL[0]]["revision"]) == ("complete", 2)
    assert (by_step[PARTIAL[1]]["status"], by_step[PARTIAL[1]]["ranks_missing"]) == ("partial", 1)
    assert by_step[0]["ranks_missing"] == 0 and by_step[0]["finalised_at"].tzinfo is not None
    assert undefined == {
        (9, "mean"): "the denominator `n` is zero",
        (10, "hi"): "no fragment carried a value of `hi`",
    }
    # pandas: float64 columns, NaN where undefined, the reasons in attrs
    assert list(frame.columns) == [
        *("step", "status", "revision", "ranks_missing", "finalised_at"),
        *("a", "n", "hi", "mean"),
    ]
    assert len(frame) == len(rows) and str(frame["a"].dtype) == "float64"
    assert str(frame["finalised_at"].dtype).endswith(", UTC]")
    assert frame["a"].tolist()[:7] == [r["a"] for r in rows[:7]]
    assert math.isnan(frame.loc[9, "mean"]) and frame.attrs["undefined"] == undefined
    # polars: null where undefined, NaN where the value is NaN
    assert polars.schema["a"] == pl.Float64 and polars.height == len(rows)
    assert polars["mean"][9] is None and math.isnan(polars["mean"][7])
    assert polars["a"].to_list()[:7] == frame["a"].tolist()[:7] == [r["a"] for r in rows[:7]]
    assert polars.filter(pl.col("step") == 8)["a"].item() == math.inf


def test_a_window_of_metrics_and_steps_and_one_step(served: ServedService) -> None:
    _filled(served.url)
    with Client(served.url) as client:
        run = client.run("r")
        window = run.steps(["mean"], start=995, end=1004, format="pandas")
        one = run.step(8)
        opened = run.step(STEPS + 5)
    assert list(window.columns)[-1] == "mean" and "a" not in window.columns
    assert window["step"].tolist() == list(range(995, 1005))  # across a page boundary
    assert window["mean"].tolist() == [_expected(s)["mean"] for s in range(995, 1005)]
    assert one["metrics"]["mean"]["value"] == math.inf and one["status"] == "complete"
    assert opened["status"] == "open" and opened["revision"] == 0


def test_compare_runs_and_clear_errors(served: ServedService) -> None:
    _filled(served.url)
    assert httpx.post(f"{served.url}/v1/runs", json={"name": "s", **SPEC}).status_code == 201
    _post(served.url, "s", _body([1, 2], 0))
    _post(served.url, "s", _body([1, 2], 1))
    with Client(served.url) as client:
        assert [r["name"] for r in client.runs()] == ["r", "s"]
        both = client.compare(["r", "s"], "mean", end=3, format="polars")
        with pytest.raises(ReadError) as unknown:
            client.run("nope")
        with pytest.raises(ReadError) as metric:
            client.run("r").steps(["nope"])
    assert both["step"].to_list() == [0, 1, 2, 3]
    assert both["r"].to_list() == [_expected(s)["mean"] for s in range(4)]
    assert both["s"].to_list() == [None, _expected(1)["mean"], _expected(2)["mean"], None]
    assert (unknown.value.code, unknown.value.status) == ("unknown_run", 404)
    assert (metric.value.code, metric.value.status) == ("metric_not_found", 404)
    assert "nope" in metric.value.message


def test_a_rate_limited_read_waits_out_retry_after(
    served: ServedService, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert httpx.post(f"{served.url}/v1/runs", json={"name": "r", **SPEC}).status_code == 201
    _post(served.url, "r", _body(list(range(STEPS)), 0))
    _post(served.url, "r", _body(list(range(STEPS)), 1))
    served.stop()
    served.env = {"STEPTALLY_RATE_LIMIT_PER_S": "1", "STEPTALLY_RATE_LIMIT_BURST": "2"}
    served.start()  # a bucket of two requests, one more a second: the read must wait
    waits: list[float] = []

    def sleep(s: float) -> None:
        waits.append(s)
        time.sleep(s)

    with Client(served.url, sleep=sleep) as client:
        rows = client.run("r").steps(["mean"], format="records")  # 4 requests
    assert [r["step"] for r in rows] == list(range(STEPS))  # nothing lost to a 429
    assert len(waits) >= 2 and all(w >= 1 for w in waits)  # each as its Retry-After said


def _following(client: Client, run: str) -> tuple[queue.Queue[dict[str, Any]], Any]:
    """The run's follower on a thread, its steps on a queue, once its stream is open."""
    steps: queue.Queue[dict[str, Any]] = queue.Queue()
    follower = client.run(run).follow()

    def read() -> None:
        for step in follower:
            steps.put(step)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 10
    while follower.last_event_id is None:
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.02)
    return steps, follower


def _taken(steps: queue.Queue[dict[str, Any]], n: int, timeout: float = 20) -> list[int]:
    deadline = time.monotonic() + timeout
    return [steps.get(timeout=max(0.01, deadline - time.monotonic()))["step"] for _ in range(n)]


def test_a_follower_misses_nothing_across_a_restart_of_the_service(
    served: ServedService,
) -> None:
    url = served.url
    assert httpx.post(f"{url}/v1/runs", json={"name": "r", **SPEC}).status_code == 201
    with Client(url) as client:
        steps, follower = _following(client, "r")
        for s in range(3):
            _post(url, "r", _body([s], 0))
            _post(url, "r", _body([s], 1))
        assert _taken(steps, 3) == [0, 1, 2]
        served.stop(signal.SIGKILL)
        served.start()
        for s in range(3, 6):  # before the follower is back: replayed on its reconnect
            _post(url, "r", _body([s], 0))
            _post(url, "r", _body([s], 1))
        assert _taken(steps, 3) == [3, 4, 5]
        _post(url, "r", _body([6], 0))
        _post(url, "r", _body([6], 1))
        assert _taken(steps, 1) == [6]
        assert follower.reconnects >= 1
        with pytest.raises(queue.Empty):
            steps.get(timeout=1.5)  # none twice
