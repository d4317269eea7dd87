"""Alembic environment: the same settings and models as the service.

The URL comes from ``config.attributes["database_url"]`` (set by
``steptally.service.store.migration.alembic_config``), or a connection passed in
``config.attributes["connection"]``, else from :class:`Settings` (the
``STEPTALLY_DATABASE_URL`` environment variable).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from steptally.service.settings import Settings
from steptally.service.store.engine import make_engine
from steptally.service.store.models import Base

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    url = config.attributes.get("database_url") or Settings().database_url
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = config.attributes.get("database_url") or Settings().database_url
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            _run(conn)
            conn.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
