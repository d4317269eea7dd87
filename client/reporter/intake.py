"""The bounded queue between the training thread and the background thread.

``put`` queues a fragment and ``commit`` the commit of a step; the background thread's
``drain`` takes them in the order they were queued and numbers them there: each
fragment gets its ``seq`` within its step (for this rank), and each commit the number
of fragments of its step logged before it. Several threads may log at once, and every
seq of a step is unique and contiguous, because the order of one deque is the order of
the calls.

A queued fragment takes no lock and writes no counter on the calling thread:
``deque.append`` is atomic, the queue is bounded by its length (fewer than
``max_items`` items, and fewer than ``max_bytes ÷ (8·n + ENTRY_OVERHEAD)`` for the
largest fragment size ``n`` seen, so what waits never holds more than ``max_bytes``
of values), and how many calls were accepted is what was drained, dropped or is still
queued, read under the lock that ``drain`` pops under. A counter would be a new int
object per call, and what a ``log()`` right after a stretch of other work costs is
mostly cache misses, one per object and piece of code it touches: a lock alone cost
about 5 µs there.
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
        "_commit_order", "_committed", "_dropped", "_dropped_total", "_largest", "_queue",
        "_seqs", "_taken", "capture", "cuda_live", "float_sizes", "lock", "max_bytes", "max_items",
        "on_drop", "rank", "tensor_sizes", "wake",
    )  # fmt: skip  # slots: fewer memory reads on the calling thread than a __dict__

    def __init__(self, rank: int, max_items: int, max_bytes: int, capture: Capture) -> None:
        self.rank = rank
        self.capture = capture  # checks, on the draining thread, what log() queued unchecked
        # Sizes of fragments that passed every check on the calling thread, by the kind
        # of their values, each with the queue bound: a later fragment of one of these
        # sizes is checked on the draining thread (see logger). Changed in place only,
        # since the one-frame log() holds them.
        self.float_sizes: dict[int, int] = {}
        self.tensor_sizes: dict[int, int] = {}
        self.cuda_live: Callable[[], bool] = _no_cuda  # torch.cuda.is_initialized, once seen
        self._largest = 0  # the most values of a fragment checked so far
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.lock = threading.Lock()  # commits, drops and the drain; never a queued fragment
        self.wake = threading.Event()
        self._queue: deque[Entry | Commit | Record] = deque()
        self._taken = 0  # items drained, under the lock
        self._dropped_total = 0  # fragments dropped here, under the lock
        self._seqs: dict[int, int] = {}  # the draining thread's: next seq of each step
        self._dropped: dict[int, int] = {}  # fragments dropped here, by step
        self._committed: set[int] = set()
        self._commit_order: deque[int] = deque()
        self.on_drop: Callable[[], None] = lambda: None  # told of each dropped fragment

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's queued items are the parent's to send."""
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self._queue.clear()  # in place: the one-frame log() holds it
        self._taken = self._dropped_total = 0
        self.float_sizes.clear()  # the first fragment checked at once again
        self.tensor_sizes.clear()
        self._largest = 0

    def __len__(self) -> int:
        return len(self._queue)

    def fragments(self) -> int:
        return sum(1 for item in list(self._queue) if type(item) is not Commit)

    def accepted(self) -> int:
        """Every call accepted so far: fragments (dropped ones too) and commits."""
        with self.lock:
            return self._taken + self._dropped_total + len(self._queue)

    def bound(self, n: int) -> int:
        """How many items may wait when a fragment of ``n`` values is queued: as many
        as ``max_bytes`` holds of the largest fragments seen, this one included."""
        most = max(n, self._largest)
        return min(self.max_items, self.max_bytes // (8 * most + ENTRY_OVERHEAD))

    def logger(self, checked: Callable[[int, Any], None]) -> Callable[[int, Any], None]:
        """The training thread's ``log(step, fragments)``: what it must do at once, in
        one Python frame, and everything else on the draining thread.

        A dict of a size whose earlier fragment passed every check here, with values
        of that fragment's kind, is queued as ``(step, its copy, *each tensor's
        _version)``: no name is looked at here, and no tensor read. Floats (and ints)
        are told apart by ``sum(values, 0.0)`` being a float, one C loop with no call
        per value; tensors by having a ``_version``. Its names, counts, shapes and
        dtypes are checked when it is drained (:func:`~.capture.entry_of`); a fragment
        that fails is refused there, counted and logged, and its step's commit still
        counts it. Anything else (the first fragment of each size and kind, other
        mappings, other values, errors) goes to ``checked``, which checks everything at
        once and raises for a programming error. A tensor is held only off CUDA (its device is
        read only once this process has a CUDA context): a CUDA tensor is copied by
        ``checked``.

        Each object and piece of code that a call touches after a stretch of other
        work is a cache miss, so this is all one frame and makes no object but the
        record: a ``log()`` of 32 floats right after the step's work took 26 µs through
        the three frames of the checked path, 11 µs here (host tensors 45–58 → 16–21
        µs), where the same values' list took 9.
        """
        committed, queue = self._committed, self._queue
        float_bound, tensor_bound = self.float_sizes.get, self.tensor_sizes.get
        drop = self._drop

        def log(step: int, fragments: Mapping[str, Any]) -> None:
            if type(fragments) is not dict or type(step) is not int or step < 0:
                return checked(step, fragments)
            n = len(fragments)
            bound = float_bound(n, -1)  # -1: no fragment of this size was checked
            try:
                plain = bound >= 0 and type(sum(fragments.values(), 0.0)) is float
            except Exception:  # not numbers: the checked path says what is wrong
                return checked(step, fragments)
            if plain:
                record: Record = (step, fragments.copy())
            else:
                bound = tensor_bound(n, -1)
                if bound < 0:
                    return checked(step, fragments)
                values = fragments.values()
                try:
                    record = (step, fragments.copy(), *map(_version, values))
                except AttributeError:  # not all tensors
                    return checked(step, fragments)
                if self.cuda_live() and countOf(map(_is_cpu, values), True) != n:
                    return checked(step, fragments)  # CUDA tensors: staged by the checked path
            if step in committed:
                return checked(step, fragments)
            if len(queue) >= bound:
                return drop(step)
            queue.append(record)
            return None

        return log

    def checked_size(self, n: int, tensors: bool) -> None:
        """A fragment of ``n`` values (host tensors, or numbers) passed every check on
        the calling thread: later ones of that size and kind take the one-frame log()."""
        sizes, other = (
            (self.tensor_sizes, self.float_sizes)
            if tensors
            else (self.float_sizes, self.tensor_sizes)
        )
        if n not in sizes:
            if tensors:
                reads = TensorReads.get()
                if reads is not None:
                    self.cuda_live = reads.cuda_live
            other.pop(n, None)
            sizes[n] = bound = self.bound(n)
            self._largest = max(n, self._largest)
            for known in (self.float_sizes, self.tensor_sizes):
                known.update(dict.fromkeys(known, bound))  # in place: log() holds them

    def _drop(self, step: int) -> None:
        with self.lock:
            self._dropped[step] = self._dropped.get(step, 0) + 1
            self._dropped_total += 1
        self.on_drop()

    def put(self, entry: Entry | Record) -> bool:
        """Queue ``entry``; False when the queue is full and it was dropped (then
        ``on_drop`` is told)."""
        if type(entry) is tuple:
            step, n, tensors = entry[0], len(entry[1]), entry[2]  # as many values as names
        else:
            step, n = entry.step, len(entry.values)  # type: ignore[union-attr]
            tensors = entry.versions is not None or (  # type: ignore[union-attr]
                entry.staged is not None and bool(entry.staged.held)  # type: ignore[union-attr]
            )
        if step in self._committed:
            raise FragmentError(
                f"step {step} was already committed by rank {self.rank}; log every "
                "fragment of a step before commit(step)"
            )
        if len(self._queue) >= self.bound(n):
            self._drop(step)
            return False
        self._queue.append(entry)
        self.checked_size(n, tensors)
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
            self._queue.append(Commit(step, self.rank, -1))  # a commit is never dropped

    def drain(self) -> list[Entry | Commit]:
        """Everything queued, oldest first, numbered: on the draining thread only."""
        queue, seqs, capture = self._queue, self._seqs, self.capture
        with self.lock:  # what was queued by now; later puts wait their turn
            items = [queue.popleft() for _ in range(len(queue))]
            self._taken += len(items)
        out: list[Entry | Commit] = []
        for item in items:
            if isinstance(item, Commit):
                step = item.step
                with self.lock:
                    dropped = self._dropped.pop(step, 0)
                out.append(Commit(step, self.rank, seqs.pop(step, 0) + dropped))
                continue
            entry = entry_of(item, capture)
            seq = seqs.get(entry.step, 0)
            entry.seq, seqs[entry.step] = seq, seq + 1
            out.append(entry)
        return out


def _no_cuda() -> bool:
    return False
