"""A batch that fails inside a group fails alone: the group's other batches are stored
and acknowledged, and the groups after it are stored as before.

A group of two runs goes one savepoint per batch on the writer's own connection. Two
things could break that on PostgreSQL: the failing batch's rollback to its savepoint
made psycopg deallocate every prepared statement of the connection (once it had
prepared one of its own), so that every later batch on it failed; and a batch whose
statement failed in the database rolled the whole transaction back, the batches
before it in the group included, which were then answered as stored. A gate holds a
first ingest at its ``COMMIT`` so that the batches under test queue into one group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from fastapi.testclient import TestClient

from steptally.service.app import create_app
from steptally.service.settings import Settings
from tests.integration.test_service_group_commit import _run_gated, commit_gate

Api = Any  # the `api` fixture of conftest.py


def _send(api: Api, run: str, step: int, rank: int, a: float) -> Any:
    return lambda: api.send([(step, rank, 0, {"a": a, "n": 1})], [(step, rank, 1)], run=run)


def test_a_conflict_in_a_group_of_two_runs_fails_alone_and_the_writer_goes_on(
    make_client: Any, api_of: Any
) -> None:
    app, client = make_client(
        ingest_group_max_batches=64, ingest_writers=1, ingest_loop_writer=False
    )
    api = api_of(client)
    for run in ("r", "q"):
        assert api.register(name=run).status_code == 201
    with commit_gate(app) as gate:
        # groups of two runs, one savepoint a batch, enough for a driver that prepares
        # a statement on its fifth run to have prepared its own
        for step in range(6):
            head, answers = _run_gated(
                app,
                gate,
                _send(api, "r", 100 + step, 0, 1.0),
                [_send(api, "r", step, 0, 1.0 + step), _send(api, "q", step, 0, 2.0 + step)],
            )
            assert [head.status_code, *(a.status_code for a in answers)] == [200] * 3
            assert gate.commits == 2  # the gated batch, then the two runs' group
        # (0, 0, 0) of r again with another value: a conflict, in a group with q's batch
        head, (conflict, good) = _run_gated(
            app,
            gate,
            _send(api, "r", 106, 0, 1.0),
            [_send(api, "r", 0, 0, 99.0), _send(api, "q", 10, 0, 7.5)],
        )
        assert gate.commits == 2
    assert head.status_code == 200
    assert conflict.status_code == 409, conflict.text
    assert conflict.json()["error"]["code"] == "fragment_conflict"
    assert good.status_code == 200, good.text
    assert good.json() == {"accepted": 1, "duplicates": 0, "commits": 1, "finalised": []}
    for step in range(11, 14):  # later groups of both runs, on the same writer
        with commit_gate(app) as gate:
            head, answers = _run_gated(
                app,
                gate,
                _send(api, "r", 200 + step, 0, 1.0),
                [_send(api, "r", step, 0, 0.25 * step), _send(api, "q", step, 1, 0.5 * step)],
            )
        assert [head.status_code, *(a.status_code for a in answers)] == [200] * 3
    assert api.value(0, "a", run="r") == 1.0  # the conflict changed nothing
    assert api.value(10, "a", run="q") == 7.5
    for step in range(11, 14):
        assert api.value(step, "a", run="r") == 0.25 * step
        assert api.value(step, "a", run="q") == 0.5 * step


@pytest.mark.postgres
def test_a_statement_that_fails_in_a_group_keeps_the_batches_before_it(
    postgres_url: str, empty_database: Callable[[str], None], api_of: Any
) -> None:
    empty_database(postgres_url)
    settings = Settings(
        database_url=postgres_url,
        ingest_group_max_batches=64,
        ingest_writers=1,
        database_statement_timeout_s=1.0,
        ingest_loop_writer=False,  # the writer threads' groups
    )
    app = create_app(settings, sweep=False)
    with TestClient(app) as client:
        _fail_inside_a_group(app, api_of(client), postgres_url)


def _fail_inside_a_group(app: Any, api: Api, db_url: str) -> None:
    for run in ("r", "q"):
        assert api.register(name=run).status_code == 201
    assert _send(api, "q", 0, 0, 1.0)().status_code == 200
    plain = db_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain) as holder:
        # q's step 0 held: a batch of it waits in its statement until the timeout
        held = holder.execute(
            "SELECT 1 FROM steps JOIN runs ON runs.id = steps.run_id "
            "WHERE runs.name = 'q' AND steps.step = 0 FOR UPDATE OF steps"
        ).fetchall()
        assert held == [(1,)]
        with commit_gate(app) as gate:
            head, (first, failed) = _run_gated(
                app,
                gate,
                _send(api, "r", 100, 0, 1.0),
                [_send(api, "r", 1, 0, 2.5), _send(api, "q", 0, 1, 3.0)],
                ordered=True,  # r's batch first: the one a whole rollback would undo
            )
            assert gate.commits == 2  # q's batch failed inside the group, which committed
        holder.rollback()
    assert head.status_code == 200
    assert failed.status_code == 503, failed.text
    assert failed.json()["error"]["code"] == "unavailable"
    assert first.status_code == 200, first.text
    assert first.json() == {"accepted": 1, "duplicates": 0, "commits": 1, "finalised": []}
    # acknowledged, so stored: r's batch went before q's in the group
    step = api.step(1, run="r")
    assert (step["fragments"]["received"], step["ranks_committed"]) == (1, [0])
    assert step["metrics"]["a"]["value"] == 2.5
    # nothing of q's batch; sent again, it is stored
    assert api.step(0, run="q")["fragments"]["received"] == 1
    again = _send(api, "q", 0, 1, 3.0)()
    assert again.status_code == 200, again.text
    assert again.json()["finalised"] == [{"step": 0, "status": "complete", "revision": 1}]
    assert api.value(0, "a", run="q") == 4.0


def test_a_refused_batch_leaves_the_writer_its_connection(make_client: Any, api_of: Any) -> None:
    """A batch the rules refuse, alone or in a group that then goes one batch at a time,
    is rolled back on a connection as good as before: the writer keeps it (a new one
    would connect and prepare its statements again for every refusal)."""
    app, client = make_client(
        ingest_group_max_batches=64, ingest_writers=1, ingest_loop_writer=False
    )
    api = api_of(client)
    for run in ("r", "q"):
        assert api.register(name=run).status_code == 201
    assert _send(api, "r", 0, 0, 1.0)().status_code == 200
    store = app.state.store
    [held] = store._held  # the writer's own connection
    conflict = _send(api, "r", 0, 0, 2.0)  # (0, 0, 0) again, another value
    assert conflict().status_code == 409  # alone
    with commit_gate(app) as gate:
        _, answers = _run_gated(
            app, gate, _send(api, "r", 1, 0, 1.0), [conflict, _send(api, "r", 2, 0, 3.0)]
        )
    assert [a.status_code for a in answers] == [409, 200]  # one group of one run, then one by one
    assert store._held == {held} and not held.invalidated
    assert _send(api, "q", 0, 0, 4.0)().status_code == 200
    assert store._held == {held}
    assert (api.value(0, "a", run="r"), api.value(2, "a", run="r")) == (1.0, 3.0)
