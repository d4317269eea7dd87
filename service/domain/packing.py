"""Fragment values packed as little-endian float64 over a run's metric columns.

A fragment is stored as one blob (``values``) and, when it does not carry every
column, a mask of one byte per column (``present``). The packing is canonical, so
two deliveries of the same fragment compare bytewise: absent cells hold +0.0,
trailing absent columns are trimmed (a column added to the run later changes
nothing), and the mask is None when every column of the blob is present.

An exact sum's further terms (see :mod:`steptally.client.wire`) are a third blob,
``tails``, None when there are none: for each column that has them, in increasing
order, its index and the number of terms (two little-endian uint32), then the terms as
little-endian float64. The blob's first term stays in ``values``, so a reader that
knows nothing of tails reads the correctly rounded sum.
"""

from __future__ import annotations

import functools
import struct
from array import array
from collections.abc import Iterator, Mapping, Sequence
from itertools import compress
from operator import itemgetter

from steptally.client.wire import f64_from_le_bytes, f64_to_le_bytes

Cell = tuple[bytes, bytes | None, bytes | None]
_HEADER = struct.Struct("<II")


def pack_tails(tails: Mapping[int, Sequence[float]]) -> bytes | None:
    """The canonical tails blob of ``tails`` (column → terms after the first)."""
    parts = []
    for column in sorted(tails):
        terms = array("d", tails[column])
        parts += [_HEADER.pack(column, len(terms)), f64_to_le_bytes(terms)]
    return b"".join(parts) or None


def unpack_tails(raw: bytes | None) -> Iterator[tuple[int, array[float]]]:
    """``(column, terms)`` for each column of a tails blob."""
    at = 0
    while raw and at < len(raw):
        column, n = _HEADER.unpack_from(raw, at)
        at += _HEADER.size
        yield column, f64_from_le_bytes(bytes(raw[at : at + 8 * n]))
        at += 8 * n


def tail_columns(cells: Sequence[Cell], width: int) -> list[list[float]]:
    """The further terms of every column's exact sums over all ``cells``."""
    out: list[list[float]] = [[] for _ in range(width)]
    for _, _, tails in cells:
        for column, terms in unpack_tails(tails):
            out[column].extend(terms)
    return out


def pack(
    values: Sequence[float], mask: bytes | bytearray, tails: Mapping[int, Sequence[float]] = {}
) -> Cell:
    """Canonical blobs and mask of one fragment given over all of the run's columns."""
    last = len(mask) - 1
    while last >= 0 and not mask[last]:
        last -= 1
    blob = f64_to_le_bytes(array("d", (v if p else 0.0 for v, p in zip(values, mask, strict=True))))
    blob = blob[: 8 * (last + 1)]
    kept = bytes(mask[: last + 1])
    return blob, (None if all(kept) else kept), pack_tails(tails)


def columns(
    cells: Sequence[Cell], width: int, guards: Mapping[int, int] | None = None
) -> list[list[float] | array[float]]:
    """The values of each of ``width`` columns over all ``cells``, absent ones left out.

    ``guards`` maps a column to its guard column: a guarded column keeps only the
    values of fragments that carry the guard with a value greater than zero.
    """
    full = 8 * width
    if all(p is None and len(v) == full for v, p, _ in cells):
        flat = f64_from_le_bytes(b"".join(v for v, _, _ in cells))
        mask = None
    else:
        blobs, masks = [], []
        for v, p, _ in cells:
            k = len(v) // 8
            blobs.append(v + bytes(full - len(v)))
            masks.append((b"\x01" * k if p is None else p) + bytes(width - k))
        flat = f64_from_le_bytes(b"".join(blobs))
        mask = b"".join(masks)
    out: list[list[float] | array[float]] = []
    for j in range(width):
        keep = None if mask is None else mask[j::width]
        g = (guards or {}).get(j)
        if g is not None:
            passed = bytes(v > 0 for v in flat[g::width])
            guard_keep = passed if mask is None else bytes(map(min, passed, mask[g::width]))
            keep = guard_keep if keep is None else bytes(map(min, keep, guard_keep))
        out.append(flat[j::width] if keep is None else list(compress(flat[j::width], keep)))
    return out


# -- bundles: several fragments of one (step, rank) in one stored row -------------------

_SEQ = struct.Struct("<q")


def bundled(cells: Sequence[tuple[int, Cell]]) -> tuple[int, bytes, bytes] | None:
    """One stored row for the fragments ``cells`` (``(seq, cell)`` of one (step, rank)):
    ``(key seq, values, seqs)`` — the row is keyed by the highest seq, ``values`` holds
    each fragment's blob in seq order, ``seqs`` their seqs as little-endian int64 — when
    there are two or more and every one is a full row (no mask, no tails) of one width;
    else None (each is stored as a row of its own)."""
    n = len(cells)
    if n < 2:
        return None
    ordered = sorted(cells, key=itemgetter(0))
    blobs = [cell[0] for _, cell in ordered]
    if len(set(map(len, blobs))) != 1 or any(
        c[1] is not None or c[2] is not None for _, c in ordered
    ):
        return None
    seqs = [q for q, _ in ordered]
    return seqs[-1], b"".join(blobs), struct.pack(f"<{n}q", *seqs)


@functools.lru_cache(maxsize=64)
def seqs_of(n: int) -> bytes:
    """The ``seqs`` of a bundle of the fragments 0 to ``n`` - 1 (:func:`bundled`)."""
    return struct.pack(f"<{n}q", *range(n))


def unbundled(
    seq: int, values: bytes, present: bytes | None, tails: bytes | None, seqs: bytes | None
) -> list[tuple[int, Cell]]:
    """The fragments ``(seq, cell)`` of one stored row (a bundle, or a single fragment)."""
    if seqs is None:
        return [(seq, (values, present, tails))]
    n = len(seqs) // _SEQ.size
    width = len(values) // n
    return [
        (
            _SEQ.unpack_from(seqs, _SEQ.size * i)[0],
            (values[width * i : width * (i + 1)], None, None),
        )
        for i in range(n)
    ]
