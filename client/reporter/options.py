"""The reporter's tuning knobs, with defaults that suit a training job, and where the
spool lives by default."""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class ReporterOptions:
    """How the reporter batches, bounds memory, retries and waits.

    Batches are cut at ``max_batch_fragments`` fragments, ``max_batch_bytes`` of values,
    or ``flush_interval_s`` after their first fragment, whichever comes first. At most
    ``max_queue_items`` log()/commit() calls wait in memory before being batched, and a
    fragment is queued only while fewer than ``max_queue_bytes ÷ (8·n + 32)`` do, ``n``
    the most values of any fragment so far (so what waits holds at most
    ``max_queue_bytes`` of values; a fragment not kept is counted in ``dropped``). At most
    ``max_queue_bytes`` of encoded batches wait in memory to be sent; beyond that they
    go to the spool. A batch answered with a 5xx (other than 503) more than
    ``max_server_errors`` times in a row is quarantined in the spool, and later batches
    go on.
    """

    max_batch_fragments: int = 512
    max_batch_bytes: int = 1 * MiB
    flush_interval_s: float = 0.5
    max_queue_items: int = 65536
    max_queue_bytes: int = 64 * MiB
    gzip_min_bytes: int = 4096
    timeout_s: float = 10.0
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    max_retry_after_s: float = 300.0
    exit_timeout_s: float = 10.0
    max_server_errors: int = 5

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"ReporterOptions.{f.name} must be a non-negative number")
        if self.max_batch_fragments < 1 or self.max_queue_items < 1:
            raise ValueError("max_batch_fragments and max_queue_items must be at least 1")


def default_spool_dir(url: str, run: str, rank: int) -> Path:
    """``$XDG_CACHE_HOME/steptally/spool/<run>-r<rank>-<hash>``, or under the temp dir.

    The hash of the url and the run keeps two services or two runs apart; the run
    and rank in the name make the folder easy to find by eye.
    """
    key = hashlib.sha256(f"{url}\n{run}\n{rank}".encode()).hexdigest()[:16]
    leaf = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', run)}-r{rank}-{key}"
    return default_spool_root() / leaf


def default_spool_root() -> Path:
    """The folder that holds every default spool (what ``steptally sync`` scans)."""
    cache = os.environ.get("XDG_CACHE_HOME")
    if cache:
        base = Path(cache)
    else:
        try:
            home = Path.home() / ".cache"
        except (RuntimeError, KeyError):  # no home directory to be found
            home = Path(tempfile.gettempdir()) / "nonexistent" / ".cache"
        base = home if os.access(home.parent, os.W_OK) else Path(tempfile.gettempdir())
    return base / "steptally" / "spool"
