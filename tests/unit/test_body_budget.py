"""The budget of fragment bodies decoded at once: a request waits for room, then 503."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import anyio
import pytest

from steptally.service.api.limits import BodyBudget, body_limit, is_json
from steptally.service.errors import Unavailable
from steptally.service.settings import Settings

T = TypeVar("T")


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    """``anyio.run`` on a thread of its own: an event loop another test left set on
    the main thread cannot get in the way."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(anyio.run, scenario).result()


def test_a_request_waits_for_room_and_is_503_past_its_wait() -> None:
    async def scenario() -> list[str]:
        budget = BodyBudget(capacity=100, wait_s=0.2)
        events: list[str] = []
        await budget.acquire(60)
        await budget.acquire(40)  # exactly full
        with pytest.raises(Unavailable, match="STEPTALLY_MAX_INFLIGHT_BODY_BYTES"):
            await budget.acquire(1)
        events.append(f"held {budget.held}")

        async def later() -> None:
            await anyio.sleep(0.05)
            budget.release(60)
            events.append("released 60")

        async with anyio.create_task_group() as tg:
            tg.start_soon(later)
            await budget.acquire(50)
            events.append(f"got 50, held {budget.held}")
        return events

    assert run(scenario) == ["held 100", "released 60", "got 50, held 90"]


def test_one_body_larger_than_the_budget_goes_alone() -> None:
    async def scenario() -> int:
        budget = BodyBudget(capacity=10, wait_s=0.1)
        await budget.acquire(500)
        held = budget.held
        budget.release(500)
        return held + budget.held

    assert run(scenario) == 500


@pytest.mark.parametrize(
    ("content_type", "json"),
    [
        ("application/json", True),
        ("Application/JSON; charset=utf-8", True),
        ("application/merge-patch+json", True),
        ("text/plain", False),
        ("text/json", False),
        ("application/x-www-form-urlencoded", False),
        ("", False),
    ],
)
def test_json_content_types(content_type: str, json: bool) -> None:
    assert is_json(content_type) is json


def test_each_route_has_its_body_limit() -> None:
    settings = Settings(max_body_bytes=300, max_spec_body_bytes=200, max_other_body_bytes=100)
    assert body_limit(settings, "POST", "/v1/runs") == (200, "STEPTALLY_MAX_SPEC_BODY_BYTES")
    assert body_limit(settings, "POST", "/v1/runs/r/fragments") == (300, "STEPTALLY_MAX_BODY_BYTES")
    assert body_limit(settings, "GET", "/v1/runs/r/fragments") == (
        100,
        "STEPTALLY_MAX_OTHER_BODY_BYTES",
    )
    assert body_limit(settings, "POST", "/v1/runs/a/b/fragments")[0] == 100
