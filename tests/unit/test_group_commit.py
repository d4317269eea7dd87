"""GroupCommit's queue and leader hand-over, with a fake transaction (no database)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import cast

from steptally.service.domain.batch import PreparedBatch
from steptally.service.domain.run import RunRecord
from steptally.service.store.group_commit import GroupCommit, Pending, settle_group
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


def _burst_of_two(group: GroupCommit, fake: FakeTransactions) -> threading.Thread:
    """Batch 0 in a group the fake holds, batch 1 queued behind it (two in flight at
    once: the peak), then the group let go; returns the thread that waits for batch 1."""
    first = threading.Thread(target=group.submit, args=(NO_RUN, _batch(0), 0.0))
    first.start()
    assert fake.entered.wait(10)
    second = threading.Thread(target=group.submit, args=(NO_RUN, _batch(1), 0.0))
    second.start()
    while group.queued() < 1:
        threading.Event().wait(0.001)
    fake.opened.set()
    first.join(10)
    return second


def test_a_writer_lingers_for_the_rest_of_a_burst() -> None:
    """Two were in flight at once: a writer that finds one queued waits for the next
    while it arrives within the linger, and stores them as one group."""
    fake = FakeTransactions()
    group = GroupCommit(fake, max_batches=8, max_bytes=1 << 20, linger_s=2.0)
    second = _burst_of_two(group, fake)
    threading.Event().wait(0.05)
    assert fake.groups == [[0]]  # batch 1 waits for company
    assert group.submit(NO_RUN, _batch(2), 0.0).commits == 2
    second.join(10)
    assert fake.groups == [[0], [1, 2]]
    group.close()


def test_without_a_linger_the_next_batch_goes_alone() -> None:
    fake = FakeTransactions()
    group = GroupCommit(fake, max_batches=8, max_bytes=1 << 20)
    second = _burst_of_two(group, fake)
    second.join(10)
    group.submit(NO_RUN, _batch(2), 0.0)
    assert fake.groups == [[0], [1], [2]]
    group.close()


def test_the_linger_ends_once_batches_stop_arriving() -> None:
    fake = FakeTransactions()
    group = GroupCommit(fake, max_batches=8, max_bytes=1 << 20, linger_s=0.3)
    t0 = time.monotonic()
    second = _burst_of_two(group, fake)
    second.join(10)
    took = time.monotonic() - t0
    assert fake.groups == [[0], [1]]
    assert 0.3 <= took < 2.4 + 1.0  # the linger after batch 1, under its bound of 8 rounds
    group.close()


def test_a_lone_submitter_never_lingers() -> None:
    """One batch in flight at a time: nobody else is coming, so no group waits."""
    fake = FakeTransactions()
    fake.opened.set()
    group = GroupCommit(fake, max_batches=8, max_bytes=1 << 20, linger_s=5.0)
    t0 = time.monotonic()
    for tag in range(5):
        assert group.submit(NO_RUN, _batch(tag), 0.0).commits == tag
    assert time.monotonic() - t0 < 2.5
    assert fake.groups == [[0], [1], [2], [3], [4]]
    group.close()


def test_a_lingering_writer_whose_batches_another_took_waits_again() -> None:
    """While one writer lingers (the lock let go), another may take the whole queue:
    the first then waits for the next batch, rather than taking from an empty queue
    (it once did, and its thread died)."""
    group = GroupCommit(lambda _: None, max_batches=8, max_bytes=1 << 20, linger_s=0.2)
    with group._lock:  # no writer threads (none start before a submit): this test plays them
        group._queue.append(Pending(NO_RUN, _batch(1), 0.0, 0))
        group._in_flight, group._peak = 1, 3  # more were in flight lately: it lingers
        group._last_arrival = time.monotonic()
    taken: list[list[Pending] | None] = []
    lingering = threading.Thread(target=lambda: taken.append(group._next_group()))
    lingering.start()
    threading.Event().wait(0.05)
    with group._lock:  # the other writer takes the queue meanwhile
        assert [p.batch.commits[(0, 0)] for p in group._queue] == [1]
        group._queue.clear()
    threading.Event().wait(0.4)  # past the linger: the queue is empty now
    assert lingering.is_alive() and taken == []
    with group._lock:
        group._queue.append(Pending(NO_RUN, _batch(2), 0.0, 0))
        group._arrived.notify()
    lingering.join(10)
    assert [[p.batch.commits[(0, 0)] for p in g] for g in taken if g] == [[2]]


class CountingCondition(threading.Condition):
    """A condition that counts its notifications (each a writer woken, when one waits)."""

    notified = 0

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        super().notify(n)


def test_a_burst_wakes_its_lingering_writer_at_its_first_and_last_batch() -> None:
    """Eight were in flight at once lately: of the next eight, the first wakes a writer
    (the queue was empty) and the last (the burst is queued); the six between them
    would only wake it to wait again, taking the GIL from the event loop each time."""
    fake = FakeTransactions()
    group = GroupCommit(fake, max_batches=16, max_bytes=1 << 20, linger_s=5.0)
    counted = CountingCondition(group._lock)
    group._arrived = counted
    fake.opened.set()
    with group._lock:  # eight were in flight at once lately
        group._peak, group._peak_at = 8, time.monotonic()
    t0 = time.monotonic()
    burst = [group.submit_future(NO_RUN, _batch(t), 0.0) for t in range(8)]
    assert [f.result(10).commits for f in burst] == list(range(8))
    assert time.monotonic() - t0 < 2.5  # woken by the last batch, not by the linger's end
    assert counted.notified == 2
    assert fake.groups == [list(range(8))]  # one group, as before
    group.close()


def test_one_writer_on_one_core_else_the_default() -> None:
    from steptally.service.store.sql import writers_for

    assert writers_for(2, cores=1) == 1
    assert writers_for(2, cores=2) == 2
    assert writers_for(4, cores=16) == 4
    assert writers_for(1, cores=8) == 1


class _Loop:
    """An event loop as ``settle_group`` sees one: what it was asked to call, and from
    which thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, tuple[object, ...]]] = []

    def call_soon_threadsafe(self, fn: object, *args: object) -> None:
        self.calls.append((fn, args))


def test_a_group_is_answered_on_each_loop_in_one_call_in_its_order() -> None:
    loops = [_Loop(), _Loop()]
    heard: list[tuple[str, object, object]] = []

    def answer(name: str) -> Callable[[object, object], None]:
        def got(outcome: object, error: object) -> None:
            heard.append((name, outcome, error))
            if name == "b1":
                raise ValueError("one answer that fails")

        return got

    group = [
        Pending(NO_RUN, _batch(i), 0.0, 0, None, None, None, (loops[i % 2], answer(f"{n}{i}")))  # type: ignore[arg-type]
        for i, n in enumerate("abcd")
    ]
    futured = Pending(NO_RUN, _batch(9), 0.0, 0)
    done = IngestOutcome(accepted=1, duplicates=0, commits=1)
    for p in group[:3]:
        p.outcome = done
    # the last of the group has neither: its transaction did not finish
    settle_group([*group, futured])
    assert [len(loop.calls) for loop in loops] == [1, 1]  # one wake-up a loop a group
    for loop in loops:
        ((fn, args),) = loop.calls
        fn(*args)  # type: ignore[operator]
    assert [(n, o) for n, o, _ in heard] == [("a0", done), ("c2", done), ("b1", done), ("d3", None)]
    assert isinstance(heard[-1][2], RuntimeError)  # and still answered after b1 raised
    assert isinstance(futured.future.exception(timeout=0), RuntimeError)  # type: ignore[union-attr]
