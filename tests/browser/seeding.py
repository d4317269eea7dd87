"""Runs and steps for the browser tests, made over the public REST API."""

from __future__ import annotations

from typing import Any

import httpx


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
