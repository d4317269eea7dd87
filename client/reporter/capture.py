"""Turning one ``log()`` call into a queue entry: every check of a fragment.

On the training thread for what :meth:`.intake.Intake.logger` does not take itself
(the first fragment of each size and kind, CUDA tensors, anything unusual), and on the
background thread for the fragments that it queued unchecked (:func:`entry_of`). It
does as little as it can: check every name and value (a programming error raises
here), convert host numbers to float, and for CUDA tensors start a non-blocking copy
into pinned host memory followed by a CUDA event. Nothing here synchronises with a device; the
background thread waits on the event (:meth:`Entry.resolve`).

A one-element host tensor of a ``sum``, ``min`` or ``max`` is checked here but read on
the background thread: each torch call that reads a value releases the GIL, and a
training thread that gives the GIL away while the background thread works waits up
to a switch interval (5 ms) to get it back, so 32 ``Tensor.item()`` calls in one
``log()`` made its p99 milliseconds. Here only attribute reads happen (no GIL hand-off);
the tensor is kept with its ``_version``, and the background thread's reading is
refused (counted, logged) if the tensor was changed in place after ``log()``. Count
tensors are read here, so that a wrong count raises at once.

A ``sum`` metric may be logged as a 1-d tensor of exact parts (the loss's sum
fragments: float64 values whose real sum is the fragment's exact value). The copy
carries them like any value; the background thread turns them into the wire's
canonical expansion (:func:`~steptally.client.algebra.exact.expansion_of`), whose first
term goes in ``values`` and the rest in ``tails``.
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Collection, Mapping
from operator import attrgetter, countOf, eq
from types import MappingProxyType
from typing import Any

from steptally.client.algebra import Kind
from steptally.client.reporter.errors import FragmentError
from steptally.client.reporter.staging import Staged, Tails, stage


class Entry:
    """The values of one fragment: ``names[i]`` has ``values[i]`` once resolved.

    ``values`` is a list of floats (some of them device values still ``staged``), or
    (``versions`` set) the list of held one-element host tensors themselves, read
    into floats by :meth:`resolve`.
    """

    __slots__ = (
        "counts", "names", "refused", "seq", "staged", "step", "tails", "values", "versions",
    )  # fmt: skip

    def __init__(
        self,
        step: int,
        names: tuple[str, ...],
        values: Any,
        staged: Staged | None = None,
        counts: list[int] | None = None,
        versions: list[int] | None = None,
    ) -> None:
        self.step = step
        self.seq = -1
        self.names = names
        self.values = values
        self.staged = staged
        self.counts = counts  # indices of count metrics whose value is still on the device
        self.versions = versions  # each held tensor's ``_version`` when it was logged
        self.tails: Mapping[int, tuple[float, ...]] = _NO_TAILS  # index → further terms
        self.refused: str | None = None  # why the background check refused it

    @classmethod
    def refusal(cls, step: int, names: tuple[str, ...], reason: str) -> Entry:
        """A fragment the background check refused: numbered like any (its step's
        commit counts it, so the step shows as incomplete), never sent."""
        entry = cls(step, names, [])
        entry.refused = reason
        return entry

    def unread(self) -> bool:
        """Whether some values are still to be read (device copies or held tensors), or
        it is a refusal to report."""
        return self.staged is not None or self.versions is not None or self.refused is not None

    def resolve(self) -> str | None:
        """Wait for device values (off the training thread); a reason if one is invalid."""
        if self.refused is not None:
            return self.refused
        if self.versions is not None:
            return self._read_held()
        if self.staged is None:
            return None
        changed = self.staged.read_held(self.values, self.names)
        if self.staged.parts:
            tails: Tails = {}
            self.staged.wait(self.values, tails)
            if tails:
                self.tails = tails
        self.staged = None
        if changed is not None:
            return changed
        for i in self.counts or ():
            if not _is_count(self.values[i]):
                return _count_message(self.names[i], self.values[i])
        return None

    def _read_held(self) -> str | None:
        """Read the held tensors into floats; a reason if one changed since ``log()``."""
        versions, self.versions = self.versions, None
        assert versions is not None
        held = Staged([], list(self.values), range(len(versions)), versions)
        return held.read_held(self.values, self.names)


def entry_of(item: Entry | Record, capture: Capture | None = None) -> Entry:
    """The entry of what capture returned (a fast path's record or an entry), or of an
    unchecked record of the training thread's ``log()``, checked here by ``capture``."""
    if type(item) is tuple:
        if type(item[1]) is dict:
            assert capture is not None
            return _checked(item, capture)
        step, names, held = item[:3]
        n = 3 + len(names)
        versions = list(item[n:]) if held else None
        return Entry(step, names, list(item[3:n]), versions=versions)
    assert isinstance(item, Entry)
    return item


def _checked(item: Record, capture: Capture) -> Entry:
    """The entry of ``(step, fragments, *versions)``, a fragment that ``log()`` queued
    unchecked (its own copy of the caller's dict, with each held tensor's ``_version``
    when it was logged): every check of :class:`Capture` runs here, off the training
    thread, and what fails is a refusal."""
    step, fragments, logged = item[0], item[1], item[2:]
    if logged and any(map(_is_cuda, fragments.values())):
        return Entry.refusal(step, tuple(fragments), _UNSTAGED)
    try:
        entry = entry_of(capture(step, fragments))
    except FragmentError as e:
        return Entry.refusal(step, tuple(fragments), str(e))
    if not logged:
        return entry
    if entry.versions is not None:  # held tensors: read later, against their versions at log()
        entry.versions = list(logged)
    elif tuple(map(_version, fragments.values())) != logged:  # read (or copied) just now
        return Entry.refusal(step, entry.names, _CHANGED)
    return entry


_UNSTAGED = (
    "a CUDA tensor was logged while this process had not initialised CUDA, so it was not "
    "copied to the host on the calling thread; log it after CUDA is initialised"
)
_CHANGED = "a tensor was changed in place after log(); log a fresh tensor (or .clone() it)"


def _is_count(x: float) -> bool:
    return x >= 0 and x.is_integer()


def _count_message(name: str, x: object) -> str:
    return f"metric {name!r} is a count, so its value must be a non-negative integer, not {x!r}"


def check_step(step: object) -> int:
    if type(step) is not int or step < 0:
        if isinstance(step, numbers.Integral) and not isinstance(step, bool) and int(step) >= 0:
            return int(step)
        raise FragmentError(f"step must be a non-negative integer, not {step!r}")
    return step


# A fragment as the fast paths leave it, one tuple: (step, names, held, *values) for
# floats, (step, names, True, *tensors, *their versions) for held host tensors.
Record = tuple[Any, ...]
_NO_TAILS: Mapping[int, tuple[float, ...]] = MappingProxyType({})
_version = attrgetter("_version")
_is_cuda = attrgetter("is_cuda")


class Capture:
    """``capture`` for one spec, with fast paths for the common cases: a dict of floats,
    and a dict of one-element host tensors of sums, minima and maxima. Their checks run
    at C speed (``map`` over the values), and nothing that reads a tensor's value.

    The fast paths return a plain tuple (``step, names, values, versions``) that the
    background thread makes an :class:`Entry`, and make as few objects as they can: a
    collection of Python's cyclic garbage collector starts inside whichever call
    crosses the allocation threshold, and after a stretch of other work each object and
    each piece of code touched is a cache miss. The key order of the last fragment is
    kept, so that a loop logging the same names reuses one tuple of them.
    """

    __slots__ = ("_order", "counts", "kinds", "names")

    def __init__(self, kinds: Mapping[str, Kind]) -> None:
        self.kinds = dict(kinds)
        self.names = frozenset(kinds)
        self.counts = frozenset(n for n, k in kinds.items() if k is Kind.COUNT)
        self._order: tuple[str, ...] = ()

    def __call__(self, step: int, fragments: Mapping[str, object]) -> Entry | Record:
        if type(fragments) is dict and fragments:
            n = len(fragments)
            names = self._order  # names already checked, in the last fast call's order
            if len(names) != n or countOf(map(eq, fragments, names), True) != n:
                if not fragments.keys() <= self.names:
                    return capture(step, fragments, self.kinds)  # says which is unknown
                names = ()
            values = fragments.values()
            if countOf(map(type, values), float) == n:
                for name in self.counts.intersection(fragments) if self.counts else ():
                    if not _is_count(fragments[name]):
                        raise FragmentError(_count_message(name, fragments[name]))
                return (step, names or self._keep_order(fragments), False, *values)
            if (not self.counts or self.counts.isdisjoint(fragments)) and _held_tensors(values):
                names = names or self._keep_order(fragments)
                return (step, names, True, *values, *map(_version, values))
        return capture(step, fragments, self.kinds)

    def _keep_order(self, fragments: dict[str, object]) -> tuple[str, ...]:
        """The names of ``fragments`` (all known), kept for the next call to match."""
        names = self._order = tuple(fragments)
        return names


def _held_tensors(values: Collection[object]) -> bool:
    """Whether ``values`` are all one-element real host tensors, to be held and read
    off-thread (if not, the general path says what is wrong, or stages device values)."""
    reads = TensorReads.get()
    n = len(values)
    return not (
        reads is None
        or countOf(map(type, values), reads.tensor) != n
        or countOf(map(reads.numel, values), 1) != n
        or countOf(map(reads.is_cpu, values), True) != n
        or not reads.real.issuperset(map(reads.dtype, values))
    )


_REAL = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8")


class TensorReads:
    """torch's attribute reads for the fast path, found once torch is imported."""

    found: TensorReads | None = None

    def __init__(self, torch: Any) -> None:
        self.tensor = torch.Tensor
        self.numel = torch.Tensor.numel
        self.is_cpu = attrgetter("is_cpu")
        self.dtype = attrgetter("dtype")
        self.real = frozenset(getattr(torch, name) for name in _REAL if hasattr(torch, name))
        # no CUDA context in this process: no tensor can be on a CUDA device
        self.cuda_live = torch.cuda.is_initialized

    @classmethod
    def get(cls) -> TensorReads | None:
        """The reads, or None while torch is not imported."""
        reads = cls.found
        if reads is None:
            torch = sys.modules.get("torch")
            if torch is None:
                return None
            reads = cls.found = cls(torch)
        return reads


def _versions(held: list[Any]) -> list[int]:
    return list(map(_version, held))


def capture(step: int, fragments: Mapping[str, object], kinds: Mapping[str, Kind]) -> Entry:
    """Check and convert one fragment; raises :class:`FragmentError` on a programming error."""
    if not isinstance(fragments, Mapping) or not fragments:
        raise FragmentError(
            f"log() takes a non-empty mapping of metric name to value, not {fragments!r}"
        )
    names = tuple(fragments)
    values: list[float] = []
    device: list[int] = []
    held: list[Any] = []
    at: list[int] = []
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)
    for name, v in fragments.items():
        kind = kinds.get(name)
        if kind is None:
            raise _unknown(name, kinds)
        t = type(v)
        if t is float:
            x: float = v  # type: ignore[assignment]
        elif t is int:
            x = _int_value(name, v)  # type: ignore[arg-type]
        elif t is tensor and _is_parts(name, v, kind):  # resolved off-thread, CPU too
            device.append(len(values))
            values.append(0.0)
            continue
        elif t is tensor and not v.is_cuda and kind is not Kind.COUNT:  # type: ignore[attr-defined]
            _check_host_scalar(name, v)
            at.append(len(values))
            held.append(v)
            values.append(0.0)
            continue
        elif t is tensor and not v.is_cuda:  # type: ignore[attr-defined]
            x = _host_tensor_value(name, v)
        else:
            got = _other_value(name, v)
            if got is None:
                device.append(len(values))
                values.append(0.0)
                continue
            x = got
        if kind is Kind.COUNT and not _is_count(x):
            raise FragmentError(_count_message(name, v))
        values.append(x)
    if not device:
        if not held:
            return Entry(step, names, values)
        return Entry(step, names, values, Staged([], held, at, _versions(held)))
    counts = [i for i in device if kinds[names[i]] is Kind.COUNT]
    staged = stage([fragments[names[i]] for i in device], device)
    staged.held, staged.at, staged.versions = held, at, _versions(held)
    return Entry(step, names, values, staged, counts)


def _check_host_scalar(name: str, v: Any) -> None:
    """What ``_host_tensor_value`` checks, by attribute reads only (no GIL hand-off)."""
    if v.numel() != 1:
        raise _shape_error(name, v)
    dtype = v.dtype
    if dtype.is_complex or dtype is sys.modules["torch"].bool:
        raise _dtype_error(name, v)


def _is_parts(name: str, v: Any, kind: Kind) -> bool:
    """Whether tensor ``v`` is a sum's exact parts (1-d, more than one element)."""
    if v.dim() != 1 or v.numel() < 2:
        return False
    if kind is not Kind.SUM or v.dtype.is_complex or not v.dtype.is_floating_point:
        raise FragmentError(
            f"metric {name!r}: a 1-d tensor of several values is a sum's exact parts, "
            f"so the metric must be a sum (it is a {kind.value}) and the tensor real "
            f"floating point (it is {v.dtype})"
        )
    return True


def _unknown(name: object, kinds: Mapping[str, Kind]) -> FragmentError:
    known = ", ".join(sorted(kinds)[:20]) + (", ..." if len(kinds) > 20 else "")
    return FragmentError(
        f"metric {name!r} is not a base metric of the run's spec (known: {known}); "
        "add it to the spec, or log only declared metrics (derived ones are computed)"
    )


def _int_value(name: str, v: int) -> float:
    try:
        return float(v)
    except OverflowError:
        message = f"metric {name!r}: the integer {v} is too large for a float64"
        raise FragmentError(message) from None


def _other_value(name: str, v: object) -> float | None:
    """A float for host values; None for a CUDA tensor (to be staged)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(v, torch.Tensor):
        return _tensor_value(name, v, torch)
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise FragmentError(
            f"metric {name!r}: the value must be a number or a one-element tensor, "
            f"not {type(v).__name__} {v!r}"
        )
    return _int_value(name, int(v)) if isinstance(v, numbers.Integral) else float(v)


def _tensor_value(name: str, v: Any, torch: Any) -> float | None:
    if v.is_cuda:
        if v.numel() != 1:
            raise _shape_error(name, v)
        if v.dtype == torch.bool or v.is_complex():
            raise _dtype_error(name, v)
        return None
    return _host_tensor_value(name, v)


def _host_tensor_value(name: str, v: Any) -> float:
    try:
        x = v.item()  # a host tensor: no device to wait for
    except RuntimeError:
        raise _shape_error(name, v) from None
    if type(x) is float:
        return x
    if type(x) is int:
        return _int_value(name, x)
    raise _dtype_error(name, v)


def _shape_error(name: str, v: Any) -> FragmentError:
    return FragmentError(
        f"metric {name!r}: a tensor value must hold exactly one element (0-d or "
        f"1-element), not shape {tuple(v.shape)}; reduce it to a scalar first"
    )


def _dtype_error(name: str, v: Any) -> FragmentError:
    return FragmentError(f"metric {name!r}: a {v.dtype} tensor is not a real number")
