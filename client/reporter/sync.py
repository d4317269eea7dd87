"""``steptally sync``: deliver the spools that reporters left behind.

A reporter leaves its spool on disk when its job ends while the service is away, when
its run could not be registered, or with parcels in quarantine. Sync finds every
spool under a root (a folder holding parcel files, or a ``quarantine/`` of them),
registers the run from the spool's ``registration`` (so a service that never saw the
run learns it), and posts the parcels oldest first, quarantined ones last, each with
``?partial=true``. A file is deleted only once the service acknowledged it; the
items the service refused are reported with their reasons and not sent again. A
spool whose service stops answering is left for a later sync.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from steptally.client.reporter.parcel import Parcel
from steptally.client.reporter.sender import Answer, Outcome, Sender
from steptally.client.reporter.spool import QUARANTINE, REGISTRATION, error_path, parse_name


@dataclass(slots=True)
class SyncReport:
    """What a sync did, in fragments (``rejected`` and ``reasons``: refused items)."""

    spools: int = 0
    delivered: int = 0
    duplicates: int = 0
    rejected: int = 0
    left: int = 0  # fragments still on disk
    left_files: int = 0
    reasons: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"{self.spools} spools: delivered {self.delivered} fragments "
            f"({self.duplicates} duplicates), rejected {self.rejected}, "
            f"left {self.left} fragments in {self.left_files} files"
        )


def spools_under(root: Path) -> list[Path]:
    """Every spool folder under ``root`` (``root`` itself included), sorted."""
    found = []
    for folder, dirs, _ in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != QUARANTINE)
        path = Path(folder)
        if _parcels(path) or _parcels(path / QUARANTINE):
            found.append(path)
    return sorted(found)


def _parcels(folder: Path) -> list[Parcel]:
    try:
        names = sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [p for p in (parse_name(folder / n) for n in names) if p is not None]


def sync(
    url: str,
    root: Path,
    token: str | None = None,
    transport: httpx.BaseTransport | None = None,
    say: Callable[[str], None] = print,
) -> SyncReport:
    """Deliver every spool under ``root`` to the service at ``url``."""
    report = SyncReport()
    token = token or os.environ.get("STEPTALLY_TOKEN") or None
    for spool in spools_under(root):
        report.spools += 1
        _sync_one(url, spool, token, transport, report, say)
    return report


def _sync_one(
    url: str,
    spool: Path,
    token: str | None,
    transport: httpx.BaseTransport | None,
    report: SyncReport,
    say: Callable[[str], None],
) -> None:
    parcels = [*_parcels(spool), *_parcels(spool / QUARANTINE)]
    registration = _registration(spool)
    if registration is None:
        _leave(report, parcels, say, f"{spool}: no {REGISTRATION} file, so the run is unknown")
        return
    sender = Sender(url, str(registration["name"]), registration, token, transport)
    try:
        answer = sender.register()
        if answer.outcome is not Outcome.OK:
            _leave(report, parcels, say, f"{spool}: cannot register: {answer.message}")
            return
        for i, parcel in enumerate(parcels):
            if not _deliver(sender, parcel, report, say):
                _leave(report, parcels[i:], say, f"{spool}: stopped")
                return
        _tidy(spool)
        say(f"{spool}: run {sender.run!r}: {len(parcels)} files delivered")
    finally:
        sender.close()


def _registration(spool: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((spool / REGISTRATION).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("name"), str) else None


def _deliver(
    sender: Sender, parcel: Parcel, report: SyncReport, say: Callable[[str], None]
) -> bool:
    assert parcel.path is not None
    answer = sender.post(parcel.path.read_bytes(), parcel.headers())
    if answer.outcome is not Outcome.OK:
        say(f"{parcel.path}: {answer.message}")
        return False
    refused = sum(1 for r in answer.refused if r.seq is not None)
    report.delivered += parcel.fragments - refused
    report.duplicates += answer.duplicates
    for reason in _reasons(answer):
        report.rejected += 1
        report.reasons.append(reason)
        say(f"{parcel.path}: rejected {reason}")
    error_path(parcel.path).unlink(missing_ok=True)
    parcel.path.unlink()
    return True


def _reasons(answer: Answer) -> Iterator[str]:
    for r in answer.refused:
        what = "commit" if r.seq is None else f"fragment seq {r.seq}"
        yield f"step {r.step} rank {r.rank} {what}: {r.code}: {r.message}"


def _leave(report: SyncReport, parcels: list[Parcel], say: Callable[[str], None], why: str) -> None:
    report.left += sum(p.fragments for p in parcels)
    report.left_files += len(parcels)
    say(f"{why}; {len(parcels)} files left")


def _tidy(spool: Path) -> None:
    """Remove what only served the delivered parcels."""
    quarantine = spool / QUARANTINE
    if quarantine.is_dir() and not any(quarantine.iterdir()):
        quarantine.rmdir()
    if not quarantine.exists():
        (spool / REGISTRATION).unlink(missing_ok=True)
