"""Content encodings and size limits of request bodies."""

from __future__ import annotations

import gzip

import pytest

from steptally.service.api.body import decode_content
from steptally.service.errors import BadJson, TooLarge, UnsupportedEncoding


def test_identity_and_gzip() -> None:
    assert decode_content(b"{}", None, 10) == b"{}"
    assert decode_content(gzip.compress(b'{"a": 1}'), "gzip", 100) == b'{"a": 1}'


def test_gzip_bomb_is_refused_without_inflating_it() -> None:
    bomb = gzip.compress(b"0" * 50_000_000)
    with pytest.raises(TooLarge, match="decompressed"):
        decode_content(bomb, "gzip", 1024)


def test_bad_encodings() -> None:
    with pytest.raises(UnsupportedEncoding):
        decode_content(b"{}", "br", 10)
    with pytest.raises(BadJson):
        decode_content(b"not gzip", "gzip", 10)
    with pytest.raises(BadJson, match="truncated"):
        decode_content(gzip.compress(b"x" * 100)[:12], "gzip", 1000)
