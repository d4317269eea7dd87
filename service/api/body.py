"""Read a request body within the size limit, and undo ``Content-Encoding: gzip``.

The limit holds twice: for the bytes on the wire (``Content-Length`` is checked
before reading, and the stream is cut off past it) and for the decompressed body,
so a small gzip bomb is refused without ever inflating it whole. A gzip body's size
trailer (ISIZE) says beforehand how much room its inflated bytes need; a body that
inflates past what its trailer says is refused as bad gzip.
"""

from __future__ import annotations

import zlib

from fastapi import Request

from steptally.service.errors import BadJson, TooLarge, UnsupportedEncoding

_GZIP_WBITS = 16 + zlib.MAX_WBITS


def _too_large(limit: int, what: str) -> TooLarge:
    return TooLarge(
        f"the {what} is larger than the limit of {limit} bytes; send smaller batches "
        "(or raise STEPTALLY_MAX_BODY_BYTES)"
    )


async def read_limited(request: Request, limit: int) -> bytes:
    """The raw body, refusing with 413 past ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, "body")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, "body")
        chunks.append(chunk)
    return b"".join(chunks)


def _is_gzip(encoding: str | None) -> bool:
    return (encoding or "").strip().lower() in ("gzip", "x-gzip")


def inflated_size(raw: bytes, encoding: str | None, limit: int) -> int:
    """The bytes ``raw`` inflates to, by its gzip trailer, at most ``limit + 1``
    (0 for a body that is not gzip)."""
    if not _is_gzip(encoding):
        return 0
    if len(raw) < 18:  # a header and a trailer: not gzip at all, refused when decoded
        return 0
    return min(limit + 1, int.from_bytes(raw[-4:], "little"))


def decode_content(
    raw: bytes, encoding: str | None, limit: int, expected: int | None = None
) -> bytes:
    """The body after its ``Content-Encoding`` (identity or gzip), at most ``limit`` bytes
    (and, for gzip, at most the ``expected`` size its trailer declares)."""
    encoding = (encoding or "identity").strip().lower()
    if encoding in ("identity", ""):
        return raw
    if encoding not in ("gzip", "x-gzip"):
        raise UnsupportedEncoding(
            f"Content-Encoding {encoding[:40]!r} is not supported; send gzip or no encoding"
        )
    room = limit if expected is None else min(limit, expected)
    inflater = zlib.decompressobj(_GZIP_WBITS)
    try:
        out = inflater.decompress(raw, room + 1)
    except zlib.error:
        raise BadJson("the body is not valid gzip data") from None
    if len(out) > room or inflater.unconsumed_tail:
        if room < limit:
            raise BadJson("the gzip body inflates past the size its trailer declares")
        raise _too_large(limit, "decompressed body")
    if not inflater.eof:
        raise BadJson("the gzip body is truncated")
    return out
