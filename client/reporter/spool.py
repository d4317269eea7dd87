"""The spool: a bounded local folder of parcels waiting for the service.

One file per parcel, the exact body that is posted, written atomically (a temp file,
then a rename), and named so that sorting the names restores the order they were
written in::

    000000000042-31337-512f-1c.json.gz
    └ counter ─┘ └pid┘ └frags┘└commits┘

The counter continues past the highest name already in the folder, so the files of a
crashed process sort before anything its successor writes, and a successor replays
them first. The pid keeps the files of a forked child apart from its parent's.

Beside the parcels, ``registration`` (JSON) holds the run's registration (name, world
size, spec, step timeout), written with the first parcel, so that ``steptally sync``
can register a run the service has never seen. ``quarantine/`` holds the parcels
the service would not take (a 4xx for the whole body, or 5xx answers beyond a bound),
each beside ``<counter>-<pid>-<n>f-<n>c.error`` saying why; a reporter never replays
them, ``steptally sync`` tries them again. A file leaves the spool only once delivered.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from steptally.client.reporter.parcel import Parcel

_NAME = re.compile(r"^(\d{12})-(\d+)-(\d+)f-(\d+)c\.json(\.gz)?$")
REGISTRATION = "registration"  # JSON
QUARANTINE = "quarantine"


def parse_name(path: Path) -> Parcel | None:
    """The parcel a spool file holds, from its name (None: not a parcel file)."""
    m = _NAME.match(path.name)
    if m is None:
        return None
    return Parcel(None, bool(m[5]), int(m[3]), int(m[4]), 1, path, path.stat().st_size)


def error_path(path: Path) -> Path:
    """Where the error of the quarantined parcel at ``path`` is written."""
    return path.with_name(path.name.split(".", 1)[0] + ".error")


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class Spool:
    """Parcels on disk, at most ``max_bytes`` of them; not thread-safe (the outbox locks)."""

    def __init__(
        self, directory: Path, max_bytes: int, registration: dict[str, Any] | None = None
    ) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._counter = 0
        self._registration = registration
        self._registered = registration is None  # written (or nothing to write)

    def check(self) -> None:
        """Raise OSError naming the directory unless parcels can be written there."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".tmp-probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"the spool directory {str(self.directory)!r} is unusable: "
                f"{exc.strerror or exc}; pass a writable spool_dir",
            ) from exc

    def _record_registration(self) -> None:
        if self._registered or self._registration is None:
            return
        data = json.dumps(self._registration, sort_keys=True).encode()
        write_atomically(self.directory / REGISTRATION, data)
        self._registered = True

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
        """Put ``parcel`` on disk (its body leaves memory); False (nothing written)
        when the spool is full."""
        assert parcel.body is not None
        if not self.has_room(parcel.size):
            return False
        self.directory.mkdir(parents=True, exist_ok=True)
        self._record_registration()
        path = self.directory / self._new_name(parcel)
        write_atomically(path, parcel.body)
        parcel.stored_at(path)
        self.nbytes += parcel.size
        return True

    def _new_name(self, parcel: Parcel) -> str:
        suffix = ".json.gz" if parcel.gzipped else ".json"
        name = f"{self._counter:012d}-{os.getpid()}-{parcel.fragments}f-{parcel.commits}c{suffix}"
        self._counter += 1
        return name

    def quarantine(self, parcel: Parcel, body: bytes, error: str) -> Path:
        """Keep ``parcel`` in ``quarantine/`` with its ``error``; where it now lies."""
        folder = self.directory / QUARANTINE
        folder.mkdir(parents=True, exist_ok=True)
        self._record_registration()
        name = parcel.path.name if parcel.path is not None else self._new_name(parcel)
        target = folder / name
        write_atomically(error_path(target), error.encode())
        if parcel.path is not None:
            os.replace(parcel.path, target)
            self.nbytes = max(0, self.nbytes - parcel.size)
        else:
            write_atomically(target, body)
        parcel.unstored()
        return target

    def tidy(self) -> None:
        """With no parcel left (none quarantined either), remove the registration."""
        if (self.directory / QUARANTINE).exists():
            return
        (self.directory / REGISTRATION).unlink(missing_ok=True)
        self._registered = self._registration is None

    def read(self, parcel: Parcel) -> bytes:
        assert parcel.path is not None
        return parcel.path.read_bytes()

    def remove(self, parcel: Parcel) -> None:
        if parcel.path is not None:
            parcel.path.unlink(missing_ok=True)
            parcel.unstored()
            self.nbytes = max(0, self.nbytes - parcel.size)
