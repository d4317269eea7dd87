"""GroupCommit's queue and leader hand-over, with a fake transaction (no database)."""

from __future__ import annotations

import threading
import time
from typing import cast

from steptally.service.domain.batch import PreparedBatch
from steptally.service.domain.run import RunRecord
from steptally.service.store.group_commit import GroupCommit, Pending
from steptally.service.store.protocol import IngestOutcome

NO_RUN = cast(RunRecord, None)  # GroupCommit only hands the run on


class FakeTransactions:
    """Stores a group by answering each batch with its own commit count; the first
    group waits at a gate until every other submitter has queued."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.groups: list[list[int]] = []
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.fail_on = fail_on

    def __call__(self, group: list[Pending]) -> None:
        tags = [p.batch.commits[(0, 0)] for p in group]
        if not self.groups:
            self.entered.set()
            assert self.opened.wait(10)
        self.groups.append(tags)
        if self.fail_on in tags:
            raise RuntimeError("the transaction failed")
        for p in group:
            p.outcome = IngestOutcome(accepted=0, duplicates=0, commits=p.batch.commits[(0, 0)])


def _batch(tag: int) -> PreparedBatch:
    return PreparedBatch(commits={(0, 0): tag})


def _submit_all(
    fake: FakeTransactions, group: GroupCommit, n: int
) -> dict[int, IngestOutcome | BaseException]:
    answers: dict[int, IngestOutcome | BaseException] = {}

    def call(tag: int) -> None:
        try:
            answers[tag] = group.submit(NO_RUN, _batch(tag), 0.0)
        except BaseException as exc:
            answers[tag] = exc

    first = threading.Thread(target=call, args=(0,))
    first.start()
    assert fake.entered.wait(10)
    rest = [threading.Thread(target=call, args=(t,)) for t in range(1, n)]
    for t in rest:
        t.start()
    while group.queued() < n - 1:
        threading.Event().wait(0.001)
    fake.opened.set()
    for t in [first, *rest]:
        t.join(10)
        assert not t.is_alive()
    return answers


def test_waiters_share_the_next_transaction_and_each_gets_its_own_outcome() -> None:
    fake = FakeTransactions()
    group = GroupCommit(fake, max_batches=4, max_bytes=1 << 20)
    answers = _submit_all(fake, group, 10)
    assert fake.groups[0] == [0]
    assert sorted(len(g) for g in fake.groups[1:]) == [1, 4, 4]
    assert sorted(t for g in fake.groups for t in g) == list(range(10))
    for tag, answer in answers.items():
        assert isinstance(answer, IngestOutcome) and answer.commits == tag
    assert group.queued() == 0


def test_a_failed_transaction_fails_its_group_only() -> None:
    fake = FakeTransactions(fail_on=5)
    group = GroupCommit(fake, max_batches=3, max_bytes=1 << 20)
    answers = _submit_all(fake, group, 7)
    failed = next(g for g in fake.groups if 5 in g)
    for tag, answer in answers.items():
        if tag in failed:
            assert isinstance(answer, RuntimeError)
            assert str(answer) == "the transaction failed"
        else:
            assert isinstance(answer, IngestOutcome) and answer.commits == tag


def test_many_submitters_never_hang() -> None:
    """Leaders hand over to the next in line; no waiter is left asleep."""
    rounds = 50
    seen: list[int] = []

    def run_group(batches: list[Pending]) -> None:
        for p in batches:
            seen.append(p.batch.commits[(0, 0)])
            p.outcome = IngestOutcome(accepted=0, duplicates=0, commits=0)

    group = GroupCommit(run_group, max_batches=3, max_bytes=1 << 20)
    threads = [
        threading.Thread(
            target=lambda t=t: [group.submit(NO_RUN, _batch(t), 0.0) for _ in range(rounds)]
        )
        for t in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert sorted(seen) == sorted(t for t in range(8) for _ in range(rounds))


def test_a_bounded_wait_lets_a_late_batch_join_the_group() -> None:
    groups: list[list[int]] = []

    def run_group(batches: list[Pending]) -> None:
        groups.append([p.batch.commits[(0, 0)] for p in batches])
        for p in batches:
            p.outcome = IngestOutcome(accepted=0, duplicates=0, commits=0)

    group = GroupCommit(run_group, max_batches=2, max_bytes=1 << 20, max_wait_s=5.0)
    first = threading.Thread(target=group.submit, args=(NO_RUN, _batch(0), 0.0))
    first.start()
    threading.Event().wait(0.05)  # the leader waits for a second batch
    assert groups == []
    group.submit(NO_RUN, _batch(1), 0.0)  # fills the group: no need to wait longer
    first.join(10)
    assert groups == [[0, 1]]


def test_the_wait_is_bounded() -> None:
    groups: list[int] = []

    def run_group(batches: list[Pending]) -> None:
        groups.append(len(batches))
        for p in batches:
            p.outcome = IngestOutcome(accepted=0, duplicates=0, commits=0)

    group = GroupCommit(run_group, max_batches=8, max_bytes=1 << 20, max_wait_s=0.02)
    t0 = time.monotonic()
    group.submit(NO_RUN, _batch(0), 0.0)
    took = time.monotonic() - t0
    assert groups == [1]
    assert 0.02 <= took < 2.0


def test_a_waiter_that_gives_up_leaves_the_writer_working() -> None:
    # the HTTP layer's deadline cancels its wait: the batch is stored all the same, and
    # the writer goes on to the next group (it once died setting the cancelled result)
    fake = FakeTransactions()
    group = GroupCommit(fake, max_batches=4, max_bytes=1 << 20)
    first = group.submit_future(NO_RUN, _batch(0), 0.0)
    assert fake.entered.wait(10)
    assert first.cancel()
    fake.opened.set()
    answer = group.submit(NO_RUN, _batch(1), 0.0)
    assert answer.commits == 1 and fake.groups == [[0], [1]]
    group.close()
