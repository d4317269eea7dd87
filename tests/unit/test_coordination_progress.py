"""Decoding an open step's progress keys, and when a copy may stand for the database's."""

from __future__ import annotations

from steptally.service.coordination.progress import agrees, decode


def test_decode_reads_bits_from_the_top_of_each_byte() -> None:
    declared = bytes(64) + (7).to_bytes(8, "big")  # rank 8 declared 7
    assert decode(b"\x80\x80", declared) == {0: 0, 8: 7}
    assert decode(b"\xe0", bytes(8) + (2**63 - 1).to_bytes(8, "big")) == {
        0: 0,
        1: 2**63 - 1,
        2: 0,
    }
    assert decode(None, None) == {}
    assert decode(b"\x00\x00", None) == {}
    assert decode(b"\x01", b"") == {7: 0}  # a bit without its count yet reads 0


def test_a_copy_agrees_only_with_the_same_count_and_total() -> None:
    assert agrees({0: 3, 2: 1}, (2, 4))
    assert agrees({}, (0, 0))
    assert not agrees({0: 3}, (2, 4))  # a commit missing
    assert not agrees({0: 3, 2: 0}, (2, 4))  # a count missing
    assert not agrees({0: 3, 2: 1}, None)
