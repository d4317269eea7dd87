"""Exact partial states, compiled (``_partial.c``; what they hold: ``partial.py``)."""

from collections.abc import Sequence

from typing_extensions import Buffer

def combine(values: Buffer, width: int, kinds: Buffer, guards: Buffer) -> bytes:
    """The stored form of the exact partial state of ``len(values) // (8 * width)``
    full-width fragments."""

def merge(states: Sequence[Buffer]) -> bytes:
    """Stored states (version 2) merged into one."""

def canonical(values: Buffer, width: int, kinds: Buffer, nan: float) -> bytes | None:
    """Full-width rows with every NaN as ``nan``, or None when a count column holds a
    value that is not a count."""
