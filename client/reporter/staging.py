"""Values that ``log()`` hands to the background thread unread: device tensors on
their way to pinned host memory, exact parts, and held host tensors (see
:mod:`.capture` for why). The background thread reads them in :meth:`Staged.wait`
and :meth:`Staged.read_held`."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from steptally.client.algebra.exact import expansion_of

Tails = dict[int, tuple[float, ...]]


class Staged:
    """Device values on their way to pinned host memory (one copy and event per
    device), and held host tensors: ``held[k]`` is the value at index ``at[k]``, and
    was at version ``versions[k]`` when it was logged."""

    __slots__ = ("at", "held", "parts", "versions")

    def __init__(
        self,
        parts: list[tuple[list[int], list[int], Any, Any, Any]],
        held: Sequence[Any] = (),
        at: Sequence[int] = (),
        versions: Sequence[int] = (),
    ) -> None:
        # (indices, sizes, pinned host tensor, event, device source kept alive)
        self.parts = parts
        self.held, self.at, self.versions = held, at, versions

    def read_held(self, values: list[float], names: tuple[str, ...]) -> str | None:
        """Read the held host tensors; a reason if one changed since ``log()``."""
        reason = None
        for i, t, version in zip(self.at, self.held, self.versions, strict=True):
            x = t.item()
            values[i] = float(x)
            if t._version != version and reason is None:
                reason = (
                    f"metric {names[i]!r}: the tensor was changed in place after log(); "
                    "log a fresh tensor (or .clone() it)"
                )
        self.held = self.at = self.versions = ()
        return reason

    def wait(self, values: list[float], tails: Tails) -> None:
        for indices, sizes, host, event, _source in self.parts:
            if event is not None:
                event.synchronize()
            flat, at = host.tolist(), 0
            for i, size in zip(indices, sizes, strict=True):
                if size == 1:
                    values[i] = flat[at]
                else:
                    values[i] = _split(flat[at : at + size], tails, i)
                at += size
        self.parts = []


def _split(parts: list[float], tails: Tails, i: int) -> float:
    """The first term of the expansion of ``parts``; the rest, if any, into ``tails``."""
    terms = expansion_of(parts)
    if len(terms) > 1:
        tails[i] = terms[1:]
    return terms[0]


def stage(tensors: list[Any], indices: list[int]) -> Staged:
    """Copy device scalars to pinned host memory without waiting, and record an event.

    One stacked copy and one event per device; under ``no_grad`` so that nothing kept
    alive here holds on to an autograd graph. Host tensors (exact parts on the CPU) are
    only concatenated — a copy, so a later change to them changes nothing — and their
    expansion waits for the background thread too.
    """
    torch = sys.modules["torch"]
    f64 = torch.float64
    groups: dict[int, tuple[list[int], list[int], list[Any]]] = {}
    with torch.no_grad():
        for i, t in zip(indices, tensors, strict=True):
            group = groups.get(t.get_device())
            if group is None:
                group = groups[t.get_device()] = ([], [], [])
            group[0].append(i)
            group[1].append(t.numel())
            group[2].append(t.reshape(-1) if t.dtype == f64 else t.reshape(-1).to(f64))
        parts = []
        for device, (idx, sizes, ts) in groups.items():
            source = torch.cat(ts)
            if device < 0:  # already on the host
                parts.append((idx, sizes, source, None, None))
                continue
            host = torch.empty(source.numel(), dtype=f64, pin_memory=True)
            host.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            parts.append((idx, sizes, host, event, source))
    return Staged(parts)
