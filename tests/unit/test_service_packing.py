"""Packing fragment values: canonical blobs, masks, and columns back out."""

from __future__ import annotations

import struct

from steptally.service.domain import packing


def test_pack_is_canonical_and_trims_trailing_absent_columns() -> None:
    full = packing.pack([1.0, 2.0], b"\x01\x01")
    assert full == (struct.pack("<2d", 1.0, 2.0), None, None)
    assert packing.pack([1.0, 2.0, 99.0], b"\x01\x01\x00") == full  # a column added later
    blob, mask, _ = packing.pack([5.0, 7.0, 3.0], b"\x00\x01\x01")
    assert blob == struct.pack("<3d", 0.0, 7.0, 3.0) and mask == b"\x00\x01\x01"
    assert packing.pack([1.0], b"\x00") == (b"", None, None)


def test_columns_fast_path_and_masked_path_agree() -> None:
    rows = [packing.pack([1.0, 2.0], b"\x01\x01"), packing.pack([3.0, 4.0], b"\x01\x01")]
    assert [list(c) for c in packing.columns(rows, 2)] == [[1.0, 3.0], [2.0, 4.0]]
    mixed = [*rows, packing.pack([0.0, 9.0], b"\x00\x01"), packing.pack([8.0], b"\x01")]
    assert [list(c) for c in packing.columns(mixed, 3)] == [[1.0, 3.0, 8.0], [2.0, 4.0, 9.0], []]


def test_tails_blob_is_canonical_and_reads_back_per_column() -> None:
    tails = {2: [2.0**-60, 2.0**-120], 0: [1e-17]}
    _, _, blob = packing.pack([1.0, 5.0, 3.0], b"\x01\x01\x01", tails)
    assert blob == (
        struct.pack("<II", 0, 1) + struct.pack("<d", 1e-17)
        + struct.pack("<II", 2, 2) + struct.pack("<2d", 2.0**-60, 2.0**-120)
    )  # fmt: skip
    assert packing.pack([1.0, 5.0, 3.0], b"\x01\x01\x01", dict(reversed(tails.items())))[2] == blob
    other = packing.pack([4.0, 5.0, 6.0], b"\x01\x01\x01", {2: [-(2.0**-70)]})
    plain = packing.pack([4.0], b"\x01")
    assert packing.tail_columns([(b"", None, blob), other, plain], 3) == [
        [1e-17],
        [],
        [2.0**-60, 2.0**-120, -(2.0**-70)],
    ]


def test_fragments_that_arrive_together_are_one_row_keyed_by_their_highest_seq() -> None:
    cells = [(q, (struct.pack("<2d", q, -q), None, None)) for q in (5, 2, 3)]
    key, values, seqs = packing.bundled(cells) or (0, b"", b"")
    assert key == 5 and seqs == struct.pack("<3q", 2, 3, 5)
    assert values == struct.pack("<6d", 2, -2, 3, -3, 5, -5)
    assert packing.unbundled(key, values, None, None, seqs) == sorted(cells)


def test_a_lone_fragment_or_one_with_a_mask_or_tails_is_a_row_of_its_own() -> None:
    full = (struct.pack("<2d", 1.0, 2.0), None, None)
    assert packing.bundled([(0, full)]) is None
    assert packing.bundled([(0, full), (1, packing.pack([1.0, 2.0], b"\x01\x00"))]) is None
    tailed = packing.pack([1.0, 2.0], b"\x01\x01", {0: [2.0**-60]})
    assert packing.bundled([(0, full), (1, tailed)]) is None
    assert packing.bundled([(0, full), (1, (struct.pack("<d", 1.0), None, None))]) is None
    assert packing.unbundled(7, *full, None) == [(7, full)]
