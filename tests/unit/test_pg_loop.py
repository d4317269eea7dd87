"""The event loop's writer of PostgreSQL's plain groups (``service/store/pg_loop.py``),
what it does with a group it cannot make: every batch of it is answered with the
error, none left waiting. (Against real PostgreSQL: ``tests/integration/test_loop_writer.py``.)"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from steptally.service.domain.batch import PreparedBatch
from steptally.service.store import pg_loop, sql_ingest
from steptally.service.store.group_commit import Pending
from steptally.service.store.sql_postgres import PostgresDialect


def test_every_batch_of_a_group_that_cannot_be_made_is_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: Any) -> Any:
        raise ValueError("a fault of ours")

    monkeypatch.setattr(sql_ingest, "fresh_write", broken)
    loop = asyncio.new_event_loop()
    try:
        store = SimpleNamespace(dialect=PostgresDialect())
        handed: list[Pending] = []
        writer = pg_loop.LoopWriter(store, loop, 8, 0.0, handed.append)  # type: ignore[arg-type]
        writer._driver = object()  # type: ignore[assignment]  # connected (never used)
        answers: list[tuple[int, Any, Any]] = []
        run = SimpleNamespace(id=1, world_size=8)
        items = [
            Pending(run, PreparedBatch(), 0.0, 0, future=None,  # type: ignore[arg-type]
                    answer=(loop, lambda o, e, i=i: answers.append((i, o, e))))
            for i in range(3)
        ]  # fmt: skip
        writer._burst.in_flight = 3
        writer._send(items)
    finally:
        loop.close()
    assert [(i, o) for i, o, _ in answers] == [(0, None), (1, None), (2, None)]
    assert all(isinstance(e, ValueError) for _, _, e in answers)
    assert handed == [] and writer._sent is None and writer._burst.in_flight == 0
