"""The one place that turns settings into a :class:`~steptally.service.store.protocol.Store`.

``create_app(settings)`` calls :func:`open_store` unless it is handed a store; tests
and tools that want the storage alone call it too, so every configuration is built
the same way:

* ``database_url`` — SQLite (the embedded default) or PostgreSQL, through
  :class:`~steptally.service.store.sql.SqlStore`, with the group-commit bounds, the
  writer threads and the database timeouts of the settings;
* ``redis_url`` set — the SQL store inside a
  :class:`~steptally.service.coordination.store.CoordinatedStore`, which keeps the
  shared schedule of open steps in Redis (SQL stays the source of truth).
"""

from __future__ import annotations

from steptally.service.coordination.keys import RedisKeys
from steptally.service.coordination.schedule import DeadlineSchedule
from steptally.service.coordination.store import CoordinatedStore
from steptally.service.settings import Settings, database_limits
from steptally.service.store.protocol import Store
from steptally.service.store.sql import SqlStore


def open_store(
    settings: Settings, *, notify: bool | None = None, opened_at: float | None = None
) -> Store:
    """The store ``settings`` describe; the caller closes it. ``notify``: on PostgreSQL,
    whether each finalisation is announced to the other processes of the database
    (unless given: whenever they do not hear each other otherwise, ``events_poll``);
    ``opened_at``: the moment it opens on the service's clock (None: ``time.time()``)."""
    sql = SqlStore.from_url(
        settings.database_url,
        settings.ingest_group_max_batches,
        settings.ingest_group_max_bytes,
        database_limits(settings),
        settings.ingest_group_max_wait_s,
        settings.ingest_writers,
        settings.ingest_group_linger_s,
        notify=settings.events_poll if notify is None else notify,
        loop_writer=settings.ingest_loop_writer,
        opened_at=opened_at,
    )
    if settings.redis_url is None:
        return sql
    keys = RedisKeys(settings.redis_prefix)
    return CoordinatedStore(sql, DeadlineSchedule.from_url(settings.redis_url, keys))
