"""Processes on one PostgreSQL database, without Redis, waking each other's event streams.

Without Redis (``steptally serve --workers N``, or replicas with
``STEPTALLY_EVENTS_POLL``), no process hears the steps the others finalise, so its
event streams read them from the database (a degraded hub,
:mod:`steptally.service.usecase.events`): at once for its own finalisations, and for the
others' at its next poll, up to ``POLL_S`` (0.5 s) later. On PostgreSQL each
finalisation's transaction also sends a notification on
:data:`~steptally.service.store.sql_postgres.FINALISED_CHANNEL` (``NOTIFY``, delivered
with its commit and only then); :class:`FinalisedWake` listens on a connection of its
own and wakes this process's streams with each one, so they read the other processes'
finalisations as soon as they are committed. The poll stays: a notification missed
while the listener reconnects is read at the next one, as before.
"""

from __future__ import annotations

import logging

import psycopg
from sqlalchemy.engine import make_url

from steptally.service.background import Background
from steptally.service.store.sql_postgres import FINALISED_CHANNEL
from steptally.service.usecase.events import EventHub

LOG = logging.getLogger(__name__)
RECONNECT_S = 1.0  # how long the listener waits before it connects again


def conninfo(database_url: str) -> str:
    """The libpq URI of a SQLAlchemy ``postgresql+psycopg://`` URL."""
    url = make_url(database_url).set(drivername="postgresql")
    return url.render_as_string(hide_password=False)


class FinalisedWake(Background):
    """A thread that listens for finalisations and wakes ``hub``'s streams."""

    def __init__(self, database_url: str, hub: EventHub) -> None:
        super().__init__("steptally-wake")
        self._conninfo = conninfo(database_url)
        self._hub = hub

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                with psycopg.connect(self._conninfo, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f"LISTEN {FINALISED_CHANNEL}")
                    self._hub.wake()  # whatever was finalised while it was not listening
                    while not self.stopping.is_set():
                        for _ in conn.notifies(timeout=0.5):
                            self._hub.wake()
            except psycopg.Error as exc:
                LOG.warning("not listening for other processes' finalisations: %s", exc)
                self.stopping.wait(RECONNECT_S)
