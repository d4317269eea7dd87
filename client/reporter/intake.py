"""The bounded queue between the training thread and the background thread.

``put`` queues a fragment and ``commit`` the commit of a step; the background thread's
``drain`` takes them in the order they were queued and numbers them there: each
fragment gets its ``seq`` within its step (for this rank), and each commit the number
of fragments of its step logged before it. Several threads may log at once, and every
seq of a step is unique and contiguous, because the order of one deque is the order of
the calls.

A queued fragment takes no lock on the calling thread: ``deque.append`` is atomic,
and the calling threads' counters (``items``, the bytes put) are written by them alone,
the draining thread's (the bytes taken, the seqs) by it alone. Two calling threads
share theirs safely under the GIL, since an augmented assignment of an attribute holds
no call or backward jump, where CPython could switch threads (a free-threaded build
would need a lock here). What a ``log()`` right
after a stretch of other work costs is mostly cache misses, one per object and piece
of code it touches, so the fewer the better: a lock alone cost about 5 µs there.
When the queue is full the fragment is dropped (and counted, under the lock), but the
step's commit still counts it, so the step shows as incomplete instead of silently
wrong.

Nothing here wakes the background thread: it drains the queue on its own timer (and
when ``flush()`` asks). A wake-up from ``put`` made the kernel switch to the woken
thread in the middle of the training thread's ``log()``, which then waited for a CPU.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping
from operator import attrgetter, countOf
from typing import Any

from steptally.client.reporter.batcher import ENTRY_OVERHEAD
from steptally.client.reporter.capture import Capture, Entry, Record, TensorReads, entry_of
from steptally.client.reporter.errors import FragmentError
from steptally.client.wire import Commit

REMEMBERED_COMMITS = 65536
_version = attrgetter("_version")
_is_cpu = attrgetter("is_cpu")


class Intake:
    __slots__ = (
        "_commit_order", "_committed", "_dropped", "_put_bytes", "_queue", "_seqs",
        "_taken_bytes", "capture", "checked_sizes", "items", "lock", "max_bytes", "max_items",
        "on_drop", "rank", "wake",
    )  # fmt: skip  # slots: fewer memory reads on the calling thread than a __dict__

    def __init__(self, rank: int, max_items: int, max_bytes: int, capture: Capture) -> None:
        self.rank = rank
        self.capture = capture  # checks, on the draining thread, what log() queued unchecked
        # sizes of fragments that passed every check on the calling thread: a later
        # fragment of one of these sizes is checked on the draining thread (see logger)
        self.checked_sizes: frozenset[int] = frozenset()
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.lock = threading.Lock()  # commits and drops; never a queued fragment
        self.wake = threading.Event()
        self.items = 0  # every accepted call, dropped fragments included
        self._queue: deque[Entry | Commit | Record] = deque()
        self._put_bytes = 0  # the calling threads'
        self._taken_bytes = 0  # the draining thread's
        self._seqs: dict[int, int] = {}  # the draining thread's: next seq of each step
        self._dropped: dict[int, int] = {}  # fragments dropped here, by step
        self._committed: set[int] = set()
        self._commit_order: deque[int] = deque()
        self.on_drop: Callable[[], None] = lambda: None  # told of each dropped fragment

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's queued items are the parent's to send."""
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self._queue = deque()
        self._put_bytes = self._taken_bytes = 0
        self.items = 0
        self.checked_sizes = frozenset()  # the first fragment checked at once again

    def __len__(self) -> int:
        return len(self._queue)

    def fragments(self) -> int:
        return sum(1 for item in list(self._queue) if type(item) is not Commit)

    def logger(self, checked: Callable[[int, Any], None]) -> Callable[[int, Any], None]:
        """The training thread's ``log(step, fragments)``: what it must do at once, in
        one Python frame, and everything else on the draining thread.

        A dict whose size is one of ``checked_sizes`` (a fragment of that size passed
        every check here before), with all values floats or all tensors, is queued as
        ``(step, its copy, *each tensor's _version)``: no name is looked at here, and
        no tensor read. Its names, counts, shapes and dtypes are checked when it is
        drained (:func:`~.capture.entry_of`); a fragment that fails is refused there,
        counted and logged, and its step's commit still counts it. Anything else
        (the first fragment of each size, other mappings, other values, errors) goes
        to ``checked``, which checks everything at once and raises for a programming
        error. A tensor is held only off CUDA (its device is read only once this
        process has a CUDA context): a CUDA tensor is copied by ``checked``.

        Each object and piece of code that a call touches after a stretch of other
        work is a cache miss, so this is all one frame: a ``log()`` of 32 floats right
        after the step's work took 26 µs through the three frames of the checked path,
        11 µs here (host tensors 45–58 → 16–21 µs), where the same values' list took 9.
        """
        intake, committed, overhead = self, self._committed, ENTRY_OVERHEAD
        tensor_reads = TensorReads.get

        def log(step: int, fragments: Mapping[str, Any]) -> None:
            if (
                type(fragments) is not dict
                or type(step) is not int
                or len(fragments) not in intake.checked_sizes
                or step < 0
                or step in committed
            ):
                return checked(step, fragments)
            values = fragments.values()
            n = len(values)
            if countOf(map(type, values), float) == n:
                record: Record = (step, fragments.copy())
            else:
                try:
                    record = (step, fragments.copy(), *map(_version, values))
                except AttributeError:  # not all tensors
                    return checked(step, fragments)
                reads = tensor_reads()
                if reads is None or (
                    reads.cuda_live() and countOf(map(_is_cpu, values), True) != n
                ):  # CUDA tensors: staged by the checked path
                    return checked(step, fragments)
            intake.items += 1
            nbytes = 8 * n + overhead
            queue = intake._queue
            if (
                len(queue) >= intake.max_items
                or intake._put_bytes - intake._taken_bytes + nbytes > intake.max_bytes
            ):
                intake._drop(step)
                return None
            intake._put_bytes += nbytes
            queue.append(record)
            return None

        return log

    def checked_size(self, n: int) -> None:
        """A fragment of ``n`` values passed every check on the calling thread."""
        if n not in self.checked_sizes:
            self.checked_sizes = self.checked_sizes | {n}

    def _drop(self, step: int) -> None:
        with self.lock:
            self._dropped[step] = self._dropped.get(step, 0) + 1
        self.on_drop()

    def put(self, entry: Entry | Record) -> bool:
        """Queue ``entry``; False when the queue is full and it was dropped (then
        ``on_drop`` is told)."""
        if type(entry) is tuple:
            step, values = entry[0], entry[1]  # as many values as names
        else:
            step, values = entry.step, entry.values  # type: ignore[union-attr]
        if step in self._committed:
            raise FragmentError(
                f"step {step} was already committed by rank {self.rank}; log every "
                "fragment of a step before commit(step)"
            )
        self.items += 1
        nbytes = 8 * len(values) + ENTRY_OVERHEAD
        if (
            len(self._queue) >= self.max_items
            or self._put_bytes - self._taken_bytes + nbytes > self.max_bytes
        ):
            self._drop(step)
            return False
        self._put_bytes += nbytes
        self._queue.append(entry)
        self.checked_size(len(values))
        return True

    def commit(self, step: int) -> None:
        """Queue the commit of ``step``, after every fragment queued for it."""
        with self.lock:
            if step in self._committed:
                raise FragmentError(f"step {step} was already committed by rank {self.rank}")
            self._committed.add(step)
            self._commit_order.append(step)
            if len(self._commit_order) > REMEMBERED_COMMITS:
                self._committed.discard(self._commit_order.popleft())
            self.items += 1
            self._queue.append(Commit(step, self.rank, -1))  # a commit is never dropped

    def drain(self) -> list[Entry | Commit]:
        """Everything queued, oldest first, numbered: on the draining thread only."""
        out: list[Entry | Commit] = []
        queue, seqs, capture = self._queue, self._seqs, self.capture
        taken = 0
        for _ in range(len(queue)):  # what was queued by now; later puts wait their turn
            item = queue.popleft()
            if isinstance(item, Commit):
                step = item.step
                with self.lock:
                    dropped = self._dropped.pop(step, 0)
                out.append(Commit(step, self.rank, seqs.pop(step, 0) + dropped))
                continue
            n = len(item[1]) if isinstance(item, tuple) else len(item.values)
            taken += 8 * n + ENTRY_OVERHEAD
            entry = entry_of(item, capture)
            seq = seqs.get(entry.step, 0)
            entry.seq, seqs[entry.step] = seq, seq + 1
            out.append(entry)
        self._taken_bytes += taken
        return out
