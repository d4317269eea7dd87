"""The outbox: parcels waiting to be sent, in order, in memory or in the spool.

The sender always takes the oldest parcel. Parcels live in memory while the service
answers and memory allows; once the service stops answering (or memory is full)
every waiting parcel is spilled to the spool and new ones follow it there, until the
spool has drained. So the spool always holds the oldest parcels, a crash loses
nothing that was spooled, and on the way back the spool goes out before newer data.
A parcel is dropped only when neither memory nor the spool has room for it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from enum import Enum

from steptally.client.reporter.parcel import Parcel
from steptally.client.reporter.spool import Spool

log = logging.getLogger("steptally.reporter")


class Placed(Enum):
    MEMORY = "memory"
    SPOOL = "spool"
    DROPPED = "dropped"


class Outbox:
    def __init__(self, spool: Spool, max_memory_bytes: int) -> None:
        self.spool = spool
        self.max_memory_bytes = max_memory_bytes
        self._parcels: deque[Parcel] = deque()
        self._memory_bytes = 0
        self._on_disk = 0
        self._fragments = 0
        self._spilling = False
        self._ready = threading.Condition()

    def reset_after_fork(self) -> None:
        """In a forked child: forget the parent's parcels (the parent sends them)."""
        self._parcels = deque()
        self._memory_bytes = self._on_disk = self._fragments = 0
        self._spilling = False
        self._ready = threading.Condition()

    def replay(self) -> list[Parcel]:
        """Queue the parcels a previous process left in the spool, ahead of anything new."""
        found = self.spool.scan()
        with self._ready:
            self._parcels.extendleft(reversed(found))
            self._on_disk += len(found)
            self._fragments += sum(p.fragments for p in found)
            self._spilling = self._spilling or bool(found)
            self._ready.notify_all()
        return found

    def fragments(self) -> int:
        """How many fragments wait in the outbox, in memory or spooled."""
        return self._fragments

    def in_memory_fragments(self) -> int:
        """Fragments of parcels held only in memory (lost if the process ends now)."""
        with self._ready:
            return sum(p.fragments for p in self._parcels if p.in_memory)

    def __len__(self) -> int:
        return len(self._parcels)

    def put(self, parcel: Parcel, force: bool = False) -> Placed:
        """Queue ``parcel`` in memory or the spool; ``force`` keeps it in memory over
        the bound rather than drop it (for the few bytes of a batch of commits)."""
        with self._ready:
            placed = self._place(parcel)
            if placed is Placed.DROPPED and force:
                self._memory_bytes += parcel.size
                placed = Placed.MEMORY
            if placed is not Placed.DROPPED:
                self._parcels.append(parcel)
                self._fragments += parcel.fragments
                self._ready.notify_all()
            return placed

    def _place(self, parcel: Parcel) -> Placed:
        fits = self._memory_bytes + parcel.size <= self.max_memory_bytes
        if not self._spilling and fits:
            self._memory_bytes += parcel.size
            return Placed.MEMORY
        self._spilling = True
        if self._to_spool(parcel):
            return Placed.SPOOL
        if fits:
            self._memory_bytes += parcel.size
            return Placed.MEMORY
        return Placed.DROPPED

    def _to_spool(self, parcel: Parcel) -> bool:
        try:
            written = self.spool.write(parcel)
        except OSError:
            return False
        if written:
            self._on_disk += 1
        return written

    def spill(self) -> list[Parcel]:
        """Move every parcel held in memory to the spool (in order); the ones moved."""
        moved = []
        with self._ready:
            self._spilling = True
            for parcel in self._parcels:
                if parcel.in_memory and self._to_spool(parcel):
                    self._memory_bytes -= parcel.size
                    moved.append(parcel)
        return moved

    def head(self, timeout: float) -> tuple[Parcel, bytes | None] | None:
        """The oldest parcel and its body (None if its spool file cannot be read),
        waiting up to ``timeout`` for one."""
        with self._ready:
            if not self._parcels and not self._ready.wait_for(lambda: self._parcels, timeout):
                return None
            parcel = self._parcels[0]
            if parcel.body is not None:
                return parcel, parcel.body
            try:
                return parcel, self.spool.read(parcel)
            except OSError as exc:
                log.error("steptally: cannot read the spooled batch %s: %s", parcel.path, exc)
                return parcel, None

    def release(self, parcel: Parcel) -> Placed | None:
        """Forget ``parcel`` but keep it on disk (for ``steptally sync``): None if it
        was there already, SPOOL if written now, DROPPED if the spool had no room."""
        with self._ready:
            if not self._parcels or self._parcels[0] is not parcel:
                return None
            placed = None
            if parcel.in_memory:
                placed = Placed.SPOOL if self._to_spool(parcel) else Placed.DROPPED
                self._memory_bytes -= parcel.size
            on_disk = parcel.path is not None
            self._forget_head(parcel, on_disk)
            return placed

    def quarantine(self, parcel: Parcel, body: bytes, error: str) -> str | None:
        """Forget ``parcel`` and keep it in the spool's quarantine with ``error``; where
        it lies (None if it could not be written: the caller counts it dropped)."""
        with self._ready:
            if not self._parcels or self._parcels[0] is not parcel:
                return None
            on_disk = parcel.path is not None
            was_in_memory = parcel.in_memory
            try:
                where = str(self.spool.quarantine(parcel, body, error))
            except OSError as exc:
                log.error("steptally: cannot quarantine a batch: %s", exc)
                where = None
            if was_in_memory:
                self._memory_bytes -= parcel.size
            self._forget_head(parcel, on_disk)
            return where

    def _forget_head(self, parcel: Parcel, on_disk: bool) -> None:
        """Drop the head from the queue, leaving any file it has where it is."""
        self._parcels.popleft()
        self._fragments -= parcel.fragments
        if on_disk:
            self._on_disk -= 1
        parcel.forget()
        if not self._on_disk:
            self._spilling = False

    def pop(self, parcel: Parcel) -> None:
        """Forget ``parcel`` (sent, or rejected for good) and its spool file."""
        with self._ready:
            if not self._parcels or self._parcels[0] is not parcel:
                return  # forgotten already (a fork reset the outbox)
            self._parcels.popleft()
            self._fragments -= parcel.fragments
            if parcel.path is not None:
                self.spool.remove(parcel)
                self._on_disk -= 1
                if not self._on_disk:
                    self.spool.tidy()
            elif parcel.body is not None:
                self._memory_bytes -= parcel.size
            parcel.forget()
            if not self._on_disk:
                self._spilling = False
