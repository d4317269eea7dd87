"""The bounded queue between the training thread and the background thread.

``put`` numbers the fragment (its ``seq`` within the step, for this rank) and queues
it, under one lock, so that several threads may log at once and every seq of a step
is unique and contiguous. ``commit`` queues the step's commit after every fragment
numbered before it. The training thread never waits here beyond that lock: when the
queue is full the fragment is dropped (and counted), but still numbered, so that the
commit announces it and the step shows as incomplete instead of silently wrong.

Nothing here wakes the background thread: it drains the queue on its own timer (and
when ``flush()`` asks). A wake-up from ``put`` made the kernel switch to the woken
thread in the middle of the training thread's ``log()``, which then waited for a CPU.
"""

from __future__ import annotations

import threading
from collections import deque

from steptally.client.reporter.batcher import ENTRY_OVERHEAD
from steptally.client.reporter.capture import Entry
from steptally.client.reporter.errors import FragmentError
from steptally.client.wire import Commit

REMEMBERED_COMMITS = 65536


class Intake:
    def __init__(self, rank: int, max_items: int, max_bytes: int) -> None:
        self.rank = rank
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.items = 0  # every accepted call, dropped fragments included
        self._queue: deque[Entry | Commit] = deque()
        self._bytes = 0
        self._seqs: dict[int, int] = {}
        self._committed: set[int] = set()
        self._commit_order: deque[int] = deque()

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's queued items are the parent's to send."""
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self._queue = deque()
        self._bytes = 0
        self.items = 0

    def __len__(self) -> int:
        return len(self._queue)

    def fragments(self) -> int:
        return sum(1 for item in list(self._queue) if isinstance(item, Entry))

    def put(self, entry: Entry) -> bool:
        """Number and queue ``entry``; False when the queue is full and it was dropped."""
        nbytes = 8 * len(entry.values) + ENTRY_OVERHEAD
        with self.lock:
            step = entry.step
            if step in self._committed:
                raise FragmentError(
                    f"step {step} was already committed by rank {self.rank}; log every "
                    "fragment of a step before commit(step)"
                )
            entry.seq = self._seqs.get(step, 0)
            self._seqs[step] = entry.seq + 1
            self.items += 1
            if len(self._queue) >= self.max_items or self._bytes + nbytes > self.max_bytes:
                return False
            self._queue.append(entry)
            self._bytes += nbytes
        return True

    def commit(self, step: int) -> Commit:
        """Queue the commit of ``step``: the number of fragments numbered for it."""
        with self.lock:
            if step in self._committed:
                raise FragmentError(f"step {step} was already committed by rank {self.rank}")
            commit = Commit(step, self.rank, self._seqs.pop(step, 0))
            self._committed.add(step)
            self._commit_order.append(step)
            if len(self._commit_order) > REMEMBERED_COMMITS:
                self._committed.discard(self._commit_order.popleft())
            self.items += 1
            self._queue.append(commit)  # never dropped: a commit is a few bytes
        return commit

    def drain(self) -> list[Entry | Commit]:
        """Everything queued, oldest first."""
        with self.lock:
            items = list(self._queue)
            self._queue.clear()
            self._bytes = 0
        return items
