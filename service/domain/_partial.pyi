"""Exact partial states, compiled (``_partial.c``; what they hold: ``partial.py``)."""

from collections.abc import Sequence

from typing_extensions import Buffer

def combine(values: Buffer, width: int, kinds: Buffer, guards: Buffer) -> bytes:
    """The stored form of the exact partial state of ``len(values) // (8 * width)``
    full-width fragments."""

def merge(states: Sequence[Buffer]) -> bytes:
    """Stored states (version 2) merged into one."""

def report(
    states: Sequence[Buffer],
) -> list[tuple[int, int, int, int, float | None, bytes | None]]:
    """Stored states (version 2) merged, each column present as ``(column, kind, n,
    non_finite, value, exact)``: its value rounded once (None: a min or max without
    one), ``exact`` a sum's or count's integer as little-endian two's complement bytes
    (a sum's in units of 2**-1074), None for a min or max."""

def canonical(values: Buffer, width: int, kinds: Buffer, nan: float) -> bytes | None:
    """Full-width rows with every NaN as ``nan``, or None when a count column holds a
    value that is not a count."""

def pack(
    steps: list[int],
    ranks: list[int],
    seqs: list[int],
    rows: bytes,
    world_size: int,
    commits: dict[tuple[int, int], int],
    kinds: Buffer,
    guards: Buffer,
    width: int,
) -> (
    tuple[
        dict[tuple[int, int, int], tuple[bytes, None, None]],
        dict[tuple[int, int, int], int],
        dict[tuple[int, int], tuple[int, bytes]],
        dict[tuple[int, int], tuple[int, bytes]],
    ]
    | None
):
    """The reporter's compact body's ``rows`` (canonical, one a fragment) packed: its
    fragments by key, each key's index, each (step, rank)'s count and partial state,
    and the plain pairs (those ``commits`` declares with all their fragments, seqs 0 to
    count - 1: count and rows joined in seq order); None when a list holds anything but
    integers from 0 to 2**63 - 1, a rank is not below ``world_size``, a key comes twice
    or the lengths do not fit."""
