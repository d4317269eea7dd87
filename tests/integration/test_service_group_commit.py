"""Group commit: concurrent batches share transactions, each stays all-or-nothing.

A gate holds the first ingest transaction open at its ``COMMIT`` while the other
requests arrive, so the grouping is deterministic: every request that arrives
meanwhile queues and goes into the next transaction together. These are the writer
threads' groups: PostgreSQL's event loop writes none (``ingest_loop_writer`` off; its
own groups: ``tests/integration/test_loop_writer.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from fractions import Fraction
from typing import Any

import pytest
from sqlalchemy import event

Api = Any  # the `api` fixture of conftest.py


class CommitGate:
    """Counts the COMMITs of an app's store engine; the first one after ``arm()`` waits
    until ``release()``."""

    def __init__(self, app: Any) -> None:
        self.engine = app.state.store.engine
        self.commits = 0
        self.armed = False
        self.entered = threading.Event()
        self.opened = threading.Event()
        event.listen(self.engine, "commit", self._on_commit)

    def _on_commit(self, _conn: Any) -> None:
        self.commits += 1
        if self.armed:
            self.armed = False
            self.entered.set()
            assert self.opened.wait(30)

    def arm(self) -> None:
        self.commits, self.armed = 0, True
        self.entered.clear()
        self.opened.clear()

    def release(self) -> None:
        self.opened.set()

    def close(self) -> None:
        event.remove(self.engine, "commit", self._on_commit)


@contextmanager
def commit_gate(app: Any) -> Iterator[CommitGate]:
    """A :class:`CommitGate` on ``app``'s engine, opened and removed at the end."""
    g = CommitGate(app)
    try:
        yield g
    finally:
        g.release()
        g.close()


@pytest.fixture
def gate(app: Any) -> Iterator[CommitGate]:
    with commit_gate(app) as g:
        yield g


def _queued(app: Any) -> int:
    queued: int = app.state.store.queued()
    return queued


def _run_gated(
    app: Any,
    gate: CommitGate,
    first: Callable[[], Any],
    rest: list[Callable[[], Any]],
    ordered: bool = False,
) -> tuple[Any, list[Any]]:
    """Run ``first`` until its transaction's COMMIT, then ``rest`` concurrently; open
    the gate once they have all queued. The answers of ``first`` and of ``rest``.
    ``ordered``: each of ``rest`` starts once the one before it has queued, so that
    the group takes them in that order."""
    answers: list[Any] = [None] * len(rest)
    first_answer: list[Any] = []
    gate.arm()
    head = threading.Thread(target=lambda: first_answer.append(first()))
    head.start()
    assert gate.entered.wait(30)

    def call(i: int) -> None:
        answers[i] = rest[i]()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(rest))]
    deadline = time.monotonic() + 5  # without grouping they never queue: the count fails
    try:
        for i, t in enumerate(threads):
            t.start()
            while ordered and _queued(app) < i + 1 and time.monotonic() < deadline:
                time.sleep(0.005)
        while _queued(app) < len(rest) and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        gate.release()
        head.join()
        for t in threads:
            t.join()
    return first_answer[0], answers


@pytest.fixture
def app_and_client(make_client: Any) -> Any:
    """Grouping on, 64 batches at most (the default, set here whatever it becomes), one
    writer (so that every batch that queues behind the gated one waits for it)."""
    return make_client(ingest_group_max_batches=64, ingest_writers=1, ingest_loop_writer=False)


def _batches(app: Any) -> float:
    return app.state.registry.get_sample_value("steptally_batches_total") or 0.0


def test_concurrent_posts_of_one_step_share_transactions(
    app: Any, api: Api, gate: CommitGate
) -> None:
    ranks = 24
    api.register(world_size=ranks, derived={"mean": "a / n"})
    api.send([(1, 0, 0, {"a": 0.5, "n": 1})])  # warms the run cache
    before = _batches(app)

    def post(rank: int) -> Callable[[], Any]:
        return lambda: api.send([(0, rank, 0, {"a": 0.1 * rank, "n": 1})], [(0, rank, 1)])

    head, answers = _run_gated(app, gate, post(0), [post(r) for r in range(1, ranks)])
    answers = [head, *answers]
    assert [a.status_code for a in answers] == [200] * ranks
    # the gated one, then all the others together; PostgreSQL then finalises the step
    # the group completed in a transaction of its own
    postgres = app.state.store.dialect.finalises_after_commit
    assert gate.commits == (3 if postgres else 2)
    assert sum(a.json()["accepted"] for a in answers) == ranks
    finalised = [f for a in answers for f in a.json()["finalised"]]
    assert finalised == [{"step": 0, "status": "complete", "revision": 1}]
    step = api.step(0)
    assert (step["status"], step["revision"]) == ("complete", 1)
    assert step["metrics"]["n"]["value"] == ranks
    exact = sum((Fraction(0.1 * r) for r in range(ranks)), Fraction(0))
    assert step["metrics"]["a"]["value"] == float(exact)
    assert _batches(app) - before == ranks  # telemetry counts every batch
    series = api.client.get("/v1/runs/r/series/mean").json()  # values stored in the group
    assert (series["steps"], series["values"]) == ([0], [float(exact / ranks)])


def test_conflicting_batch_fails_alone_inside_its_group(
    app: Any, api: Api, gate: CommitGate
) -> None:
    api.register(world_size=4)
    api.send([(0, 0, 0, {"a": 1.0, "n": 1})])
    rejects_before = (
        app.state.registry.get_sample_value(
            "steptally_requests_rejected_total", {"code": "fragment_conflict"}
        )
        or 0.0
    )

    def good(rank: int) -> Callable[[], Any]:
        return lambda: api.send([(0, rank, 0, {"a": 10.0 * rank, "n": 1})], [(0, rank, 1)])

    def bad() -> Any:  # a conflict on (0, 0, 0), plus rows that must not be stored
        return api.send(
            [(7, 0, 0, {"a": 5.0, "n": 1}), (0, 0, 1, {"a": 5.0}), (0, 0, 0, {"a": 2.0, "n": 1})],
            [(0, 0, 2)],
        )

    head, answers = _run_gated(app, gate, good(1), [good(2), bad, good(3)])
    assert head.status_code == 200
    assert [a.status_code for a in answers] == [200, 409, 200]
    assert answers[1].json()["error"]["code"] == "fragment_conflict"
    assert gate.commits == 2
    # nothing of the failing batch: no step 7, no fragment (0, 0, 1), no commit of rank 0
    assert api.client.get("/v1/runs/r/steps/7").status_code == 404
    step = api.step(0)
    assert step["status"] == "open"
    assert step["fragments"]["received"] == 4
    assert step["ranks_committed"] == [1, 2, 3]
    assert step["metrics"]["a"]["value"] == 1.0 + 10.0 + 20.0 + 30.0
    rejects = app.state.registry.get_sample_value(
        "steptally_requests_rejected_total", {"code": "fragment_conflict"}
    )
    assert rejects == rejects_before + 1
    # rank 0 completes the step afterwards, finalised once
    done = api.send([], [(0, 0, 1)]).json()
    assert done["finalised"] == [{"step": 0, "status": "complete", "revision": 1}]


def test_grouping_can_be_turned_off(make_client: Any, api_of: Any) -> None:
    app, client = make_client(ingest_group_max_batches=1, ingest_loop_writer=False)
    api = api_of(client)
    assert app.state.store.group_max_batches == 1
    gate = CommitGate(app)
    try:
        ranks = 8
        api.register(world_size=ranks)
        api.send([(1, 0, 0, {"a": 0.5, "n": 1})])
        gate.commits = 0
        barrier = threading.Barrier(ranks)
        answers: list[Any] = []

        def post(rank: int) -> None:
            barrier.wait()
            answers.append(api.send([(0, rank, 0, {"a": 1.0, "n": 1})], [(0, rank, 1)]))

        threads = [threading.Thread(target=post, args=(r,)) for r in range(ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [a.status_code for a in answers] == [200] * ranks
        # one transaction per batch (and PostgreSQL's finalisation of the step, after the
        # batch that completed it)
        assert gate.commits == ranks + app.state.store.dialect.finalises_after_commit
        assert api.step(0)["status"] == "complete"
    finally:
        gate.close()


@pytest.mark.parametrize(
    "db_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
def test_groups_of_two_replicas_do_not_deadlock(make_client: Any, api_of: Any) -> None:
    """Each replica's groups take their batches' step locks in arrival order; taken up
    front in step order instead, two replicas' groups never wait on each other in a
    cycle (a deadlock would fail a whole group)."""
    apps = [make_client(ingest_group_max_batches=64, ingest_loop_writer=False) for _ in range(2)]
    apis = [api_of(client) for _, client in apps]
    ranks, steps = 16, 4
    apis[0].register(name="d", world_size=ranks)
    answers: list[Any] = []

    def rank_worker(rank: int) -> None:
        api = apis[rank % 2]
        order = list(range(steps)) if rank % 4 < 2 else list(reversed(range(steps)))
        for step in order:
            frag = [(step, rank, 0, {"a": 1.0, "n": 1})]
            answers.append(api.send(frag, [(step, rank, 1)], run="d"))

    threads = [threading.Thread(target=rank_worker, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [a.status_code for a in answers] == [200] * (ranks * steps)
    for step in range(steps):
        got = apis[1].step(step, "d")
        assert (got["status"], got["revision"], got["metrics"]["a"]["value"]) == (
            "complete",
            1,
            float(ranks),
        )


def test_grouping_defaults_to_64_batches_on_two_writers(make_client: Any) -> None:
    app, _ = make_client(
        ingest_loop_writer=False
    )  # no ingest_group_max_batches: the database's default
    store = app.state.store
    assert (store.group_max_batches, store._group._writers) == (64, 2)


def test_a_second_writer_stores_groups_while_the_first_waits_on_its_commit(
    make_client: Any, api_of: Any, db_url: str
) -> None:
    if db_url.startswith("sqlite"):
        pytest.skip("SQLite has one writer at a time")
    app, client = make_client(
        ingest_group_max_batches=64, ingest_writers=2, ingest_loop_writer=False
    )
    api = api_of(client)
    gate = CommitGate(app)
    try:
        api.register(world_size=2)
        api.send([(9, 0, 0, {"a": 0.5, "n": 1})])
        gate.arm()
        first = threading.Thread(target=lambda: api.send([(0, 0, 0, {"a": 1.0, "n": 1})]))
        first.start()
        assert gate.entered.wait(30)  # the first writer waits at its COMMIT
        answers: list[Any] = []
        rest = threading.Thread(
            target=lambda: answers.extend(
                api.send([(1, r, 0, {"a": 2.0, "n": 1})], [(1, r, 1)]) for r in range(2)
            )
        )
        rest.start()
        rest.join(10)  # with one writer these would wait for the gate, which stays shut
        assert not rest.is_alive() and [a.status_code for a in answers] == [200, 200]
        assert answers[1].json()["finalised"] == [{"step": 1, "status": "complete", "revision": 1}]
        assert first.is_alive()
    finally:
        gate.release()
        first.join(10)
        gate.close()
    assert api.step(0)["fragments"]["received"] == 1
