"""A parcel: one encoded batch, exactly the body that is posted (and spooled).

The body is the compact form of :mod:`steptally.client.wire`, serialised with orjson
when it is installed (else json) and gzipped when it is large enough that it pays.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steptally.client.wire import FragmentBatch, encode_columnar

try:
    import orjson

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

except ImportError:  # pragma: no cover - orjson is optional

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


@dataclass(slots=True)
class Parcel:
    """An encoded batch; ``body`` is None while it lives only in the spool at ``path``.

    ``items`` counts the log()/commit() calls of this process it settles, so that
    ``flush()`` knows when everything before it has been delivered.

    A parcel is in memory (``body``), on disk (``path``), or done with (neither);
    only the methods below move it between them, whoever calls them.
    """

    body: bytes | None
    gzipped: bool
    fragments: int
    commits: int
    items: int = 1
    path: Path | None = None
    size: int = 0

    def __post_init__(self) -> None:
        if self.body is not None:
            self.size = len(self.body)

    @property
    def in_memory(self) -> bool:
        """Held only in memory: lost if the process ends now."""
        return self.path is None and self.body is not None

    def stored_at(self, path: Path) -> None:
        """Now on disk at ``path``: the body leaves memory."""
        self.path, self.body = path, None

    def unstored(self) -> None:
        """Its spool file was removed, or moved into the quarantine."""
        self.path = None

    def forget(self) -> None:
        """Out of the outbox (sent, refused, or left on disk): drop the body."""
        self.body = None

    def headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if self.gzipped:
            headers["content-encoding"] = "gzip"
        return headers


def encode(batch: FragmentBatch, gzip_min_bytes: int, items: int) -> Parcel:
    """The body of ``batch``; gzipped (level 6) once it holds ``gzip_min_bytes`` or more."""
    body = _dumps(encode_columnar(batch))
    gzipped = len(body) >= gzip_min_bytes
    if gzipped:
        body = gzip.compress(body, compresslevel=6, mtime=0)
    return Parcel(body, gzipped, len(batch), len(batch.commits), items)
