"""Runs and steps for the browser tests, made over the public REST API."""

from __future__ import annotations

import time
from typing import Any

import httpx

SPEC: dict[str, Any] = {
    "metrics": {"ratio_num": "sum", "actor_tokens": "count", "ratio_max": "max"},
    "derived": {"probs_ratio": "ratio_num / actor_tokens"},
}


def wave(step: int, rank: int) -> dict[str, Any]:
    """Fragment values of SPEC that rise with the step: ``ratio_max`` is ``1 + step``."""
    return {"ratio_num": 0.5 + step / 100 + rank / 1000, "actor_tokens": 1, "ratio_max": 1.0 + step}


class Seeder:
    """Registers runs and posts fragments and commits to one service."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=30)

    def close(self) -> None:
        self.http.close()

    def run(self, name: str, world_size: int, **spec: Any) -> dict[str, Any]:
        body = {"name": name, "world_size": world_size, **spec}
        answer = self.http.post("/v1/runs", json=body)
        assert answer.status_code == 201, answer.text
        result: dict[str, Any] = answer.json()
        return result

    def post(self, run: str, fragments: list[dict[str, Any]], commits: list[dict[str, Any]]) -> Any:
        body = {"fragments": fragments, "commits": commits}
        answer = self.http.post(f"/v1/runs/{run}/fragments", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def steps(self, run: str, steps: range, world_size: int, value: Any) -> None:
        """Every rank sends one fragment per step, ``value(step, rank)``, and commits it."""
        fragments = [
            {"step": s, "rank": r, "seq": 0, "values": value(s, r)}
            for s in steps
            for r in range(world_size)
        ]
        commits = [{"step": s, "rank": r, "fragments": 1} for s in steps for r in range(world_size)]
        self.post(run, fragments, commits)

    def step(self, run: str, step: int) -> dict[str, Any]:
        answer = self.http.get(f"/v1/runs/{run}/steps/{step}")
        assert answer.status_code == 200, answer.text
        result: dict[str, Any] = answer.json()
        return result

    def wait_for_status(self, run: str, step: int, status: str) -> dict[str, Any]:
        """The step once the service has finalised it ``status`` (the sweeper runs often)."""
        deadline = time.monotonic() + 10
        while (found := self.step(run, step))["status"] != status:
            assert time.monotonic() < deadline, f"step {step} stayed {found['status']}"
            time.sleep(0.05)
        return found
