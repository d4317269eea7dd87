"""The service's settings: one pydantic-settings class, read once at start.

Every field can be set by an environment variable with the prefix ``STEPTALLY_``
(``STEPTALLY_DATABASE_URL``, ``STEPTALLY_PORT`` …); tests build ``Settings(...)``
directly. Nothing here runs at import time.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from steptally.client.algebra.spec import SpecLimits
from steptally.service.domain.limits import RunLimits
from steptally.service.store.engine import DatabaseLimits

DEFAULT_DATABASE_URL = "sqlite:///./var/steptally.sqlite3"


class Settings(BaseSettings):
    """Everything ``create_app`` and the CLI need to know."""

    model_config = SettingsConfigDict(env_prefix="STEPTALLY_", extra="ignore")

    database_url: str = DEFAULT_DATABASE_URL
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    sweep_interval_s: float = Field(default=1.0, gt=0)
    default_step_timeout_s: float = Field(default=300.0, gt=0, allow_inf_nan=False)
    # group commit: at most this many batches (and bytes of values) share a transaction;
    # 1 gives every batch its own transaction. Unset: 64 (service/store/dialect.py;
    # bench/README.md, Scale)
    ingest_group_max_batches: int | None = Field(default=None, ge=1)
    ingest_group_max_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    # and a writer that finds fewer queued waits at most this long for more (0: never)
    ingest_group_max_wait_s: float = Field(default=0.0, ge=0, le=1.0)
    # a writer waits for the batches of a burst that are still arriving, each within
    # this long of the one before (0: never; service/store/group_commit.py)
    ingest_group_linger_s: float = Field(default=0.0003, ge=0, le=0.1)
    # threads that store the groups, each on its own connection. Unset: 2 (SQLite: they
    # take turns, one syncing its commit while the other runs its statements), or 1 in a
    # process that may run on one core only (service/store/sql.py, writers_for)
    ingest_writers: int | None = Field(default=None, ge=1, le=64)
    # the event loop writes the groups of plain pairs (what a reporter sends) itself, on a
    # connection of its own, instead of handing them to a writer thread: PostgreSQL's
    # pipelined (service/store/pg_loop.py), SQLite's stored there and synced in its
    # executor (service/store/sqlite_loop.py); off: every group goes to the writer threads
    ingest_loop_writer: bool = True
    # every wait on the database is bounded (service/store/engine.py): a hung database
    # answers 503 unavailable with Retry-After; /readyz answers within its own timeout
    database_statement_timeout_s: float = Field(default=30.0, gt=0)
    database_pool_timeout_s: float = Field(default=10.0, gt=0)
    database_connect_timeout_s: float = Field(default=5.0, gt=0)
    readyz_timeout_s: float = Field(default=2.0, gt=0)
    # and every request: no answer started by then is 503 unavailable (service/api/deadline.py)
    request_timeout_s: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    # replicas: with a Redis URL, every replica's event streams see every replica's
    # finalisations (service/coordination/); unset, each process has its own hub
    redis_url: str | None = None
    redis_prefix: str = Field(default="steptally", min_length=1)
    # event streams read each finalisation from the database (woken by this process's
    # own, polling for others') instead of sending what this process hears: needed when
    # other processes finalise steps of the same database without Redis (replicas
    # without a Redis URL); `serve --workers N` turns it on, and with Redis it is on
    # while Redis is away (service/usecase/events.py)
    events_poll: bool = False
    # access control (docs/security.md): with auth on, every route but /healthz and the
    # dashboard's pages needs a bearer token (`steptally token create`); off by default
    auth: bool = False
    # requests per second per token (per client address without one), in each replica,
    # with bursts of rate_limit_burst; 0 switches the limit off. A 4096-rank run sharing
    # one token sends about 8,200 a second (two batches a second per rank)
    rate_limit_per_s: float = Field(default=10_000.0, ge=0, allow_inf_nan=False)
    rate_limit_burst: int = Field(default=20_000, ge=1)
    # limits (docs/security.md, Limits): each is checked before the work it bounds
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)  # a fragments body, inflated
    max_spec_body_bytes: int = Field(default=1024 * 1024, gt=0)  # POST /v1/runs
    max_other_body_bytes: int = Field(default=64 * 1024, gt=0)  # every other route
    # bodies of fragments being decoded at once in a process (raw plus inflated bytes); a
    # request waits up to body_wait_s for room, then is 503 unavailable with Retry-After
    max_inflight_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    body_wait_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    max_world_size: int = Field(default=1_048_576, ge=1, le=2**31 - 1)
    max_step_timeout_s: float = Field(default=7 * 86_400.0, gt=0, allow_inf_nan=False)
    # derived expressions as a whole, with derived names expanded: operands summed over
    # the spec, deepest nesting, longest chain of derived values using one another
    max_derived_size: int = Field(default=10_000, ge=1)
    max_derived_depth: int = Field(default=200, ge=1, le=400)
    max_derived_chain: int = Field(default=16, ge=1, le=100)
    # /metrics shows the runs that registered or finalised a step within this window
    metrics_window_s: float = Field(default=86_400.0, gt=0, allow_inf_nan=False)
    # the cores `steptally serve` runs on, as a Linux CPU list ("1", "0,2", "0-3"); unset,
    # wherever the system puts it. One process runs on all of them; with `--workers N`,
    # worker i runs alone on the i-th, round robin (service/serving.py; docs/deploy.md)
    cpus: str | None = None

    @field_validator("cpus")
    @classmethod
    def _cpu_list(cls, text: str | None) -> str | None:
        if text is not None:
            cpu_list(text)  # a ValueError says what is wrong with it
        return text

    @field_validator("database_url")
    @classmethod
    def _sqlite_parent(cls, url: str) -> str:
        """Create the folder of an SQLite database file, so a fresh checkout just works."""
        path = sqlite_path(url)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        return url


MAX_CORES = 1 << 16  # Linux's own bound on CPU numbers is lower


def cpu_list(text: str) -> tuple[int, ...]:
    """The cores of a Linux CPU list ("0,2-3": 0, 2, 3), in the order written."""
    cores: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not (first.isdigit() and (last.isdigit() if dash else not last)):
            raise ValueError(f"{part.strip()!r} is not a core or a range of cores (0, 2-3)")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"the range {part.strip()!r} runs backwards")
        if high >= MAX_CORES:
            raise ValueError(f"core {high} is past the last a machine has ({MAX_CORES - 1})")
        for core in range(low, high + 1):
            if core in cores:
                raise ValueError(f"core {core} is listed twice")
            cores.append(core)
    return tuple(cores)


def run_limits(settings: Settings) -> RunLimits:
    return RunLimits(
        max_world_size=settings.max_world_size,
        max_step_timeout_s=settings.max_step_timeout_s,
        spec=SpecLimits(
            max_size=settings.max_derived_size,
            max_depth=settings.max_derived_depth,
            max_chain=settings.max_derived_chain,
        ),
    )


def database_limits(settings: Settings) -> DatabaseLimits:
    return DatabaseLimits(
        statement_timeout_s=settings.database_statement_timeout_s,
        pool_timeout_s=settings.database_pool_timeout_s,
        connect_timeout_s=settings.database_connect_timeout_s,
    )


def sqlite_path(url: str) -> Path | None:
    """The file of an ``sqlite:///…`` URL, or None for other databases and memory."""
    prefix = url.split("://", 1)[0]
    if not prefix.startswith("sqlite") or "://" not in url:
        return None
    rest = url.split("://", 1)[1]
    if not rest.startswith("/"):
        return None
    file = rest[1:].split("?", 1)[0]
    if file in ("", ":memory:"):
        return None
    return Path(file)
