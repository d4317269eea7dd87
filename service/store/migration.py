"""The schema's version: Alembic configuration, upgrade to head, and the start check."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

import steptally.migrations
from steptally.service.errors import NotMigrated

MIGRATIONS = Path(steptally.migrations.__file__).parent


def alembic_config(url: str) -> Config:
    """A programmatic Alembic config; ``migrations/env.py`` takes the URL from it."""
    config = Config(str(MIGRATIONS / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["database_url"] = url
    return config


def upgrade(url: str) -> None:
    """Create or upgrade the schema at ``url`` to the newest version."""
    command.upgrade(alembic_config(url), "head")


def head(url: str) -> str | None:
    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()


def current(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def check_current(engine: Engine, url: str) -> None:
    """Raise :class:`NotMigrated` unless the database at ``engine`` is at head."""
    have, want = current(engine), head(url)
    if have == want:
        return
    state = "not migrated" if have is None else f"at schema version {have}, not {want}"
    raise NotMigrated(
        f"the database {engine.url.render_as_string(hide_password=True)} is {state}; "
        f"run `steptally migrate --database-url '{url}'` first"
    )
