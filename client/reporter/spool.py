"""The spool: a bounded local folder of parcels waiting for the service.

One file per parcel, the exact body that is posted, written atomically (a temp file,
then a rename), and named so that sorting the names restores the order they were
written in::

    000000000042-31337-512f-1c.json.gz
    └ counter ─┘ └pid┘ └frags┘└commits┘

The counter continues past the highest name already in the folder, so the files of a
crashed process sort before anything its successor writes, and a successor replays
them first. The pid keeps the files of a forked child apart from its parent's.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from steptally.client.reporter.parcel import Parcel

_NAME = re.compile(r"^(\d{12})-(\d+)-(\d+)f-(\d+)c\.json(\.gz)?$")


class Spool:
    """Parcels on disk, at most ``max_bytes`` of them; not thread-safe (the outbox locks)."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._counter = 0

    def scan(self) -> list[Parcel]:
        """The parcels a previous process left behind, oldest first."""
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return []
        found: list[tuple[tuple[int, int], Parcel]] = []
        for name in names:
            path = self.directory / name
            if name.startswith(".tmp-"):
                path.unlink(missing_ok=True)  # a write that never completed
                continue
            m = _NAME.match(name)
            if m is None:
                continue
            size = path.stat().st_size
            parcel = Parcel(None, bool(m[5]), int(m[3]), int(m[4]), 1, path, size)
            found.append(((int(m[1]), int(m[2])), parcel))
            self._counter = max(self._counter, int(m[1]) + 1)
            self.nbytes += size
        found.sort(key=lambda pair: pair[0])
        return [parcel for _, parcel in found]

    def has_room(self, size: int) -> bool:
        return self.nbytes + size <= self.max_bytes

    def write(self, parcel: Parcel) -> bool:
        """Put ``parcel`` on disk; False (nothing written) when the spool is full."""
        assert parcel.body is not None
        if not self.has_room(parcel.size):
            return False
        self.directory.mkdir(parents=True, exist_ok=True)
        suffix = ".json.gz" if parcel.gzipped else ".json"
        name = f"{self._counter:012d}-{os.getpid()}-{parcel.fragments}f-{parcel.commits}c{suffix}"
        self._counter += 1
        path = self.directory / name
        tmp = self.directory / f".tmp-{name}"
        with open(tmp, "wb") as f:
            f.write(parcel.body)
        os.replace(tmp, path)
        parcel.path = path
        self.nbytes += parcel.size
        return True

    def read(self, parcel: Parcel) -> bytes:
        assert parcel.path is not None
        return parcel.path.read_bytes()

    def remove(self, parcel: Parcel) -> None:
        if parcel.path is not None:
            parcel.path.unlink(missing_ok=True)
            parcel.path = None
            self.nbytes = max(0, self.nbytes - parcel.size)
