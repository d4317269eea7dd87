"""The SQL schema as typed SQLAlchemy models; Alembic versions must match it.

Timestamps are Unix seconds (float64), identical on SQLite and PostgreSQL. A
fragment is one row: its values are one blob of little-endian float64 over the
run's metric columns (``metrics.col``), see :mod:`steptally.service.domain.packing`.
Several fragments of one (step, rank) that arrive together are one row (a bundle).
A finalised step's values are also kept one row per metric (``step_values``), for
series and for SQL readers such as Grafana. The fragments of each (step, rank) are
also kept combined, exactly, as one ``partials`` row, which a finalisation reads.

A pair's rows (``fragments``, ``commits``, ``partials``) and a step's values
(``step_values``) name their run without a foreign key (migrations 0012 and 0013: on
PostgreSQL each row's check cost ~15 % of a group's CPU, and about half of what a
step's finalisation cost the database): every transaction that writes them writes
their step's row too, whose foreign key to ``runs`` holds.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    PrimaryKeyConstraint,
    SmallInteger,
    String,
    Text,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

_RUN_FK = "runs.id"
REVISED = "(status = 'partial' OR revision > 1)"  # steps a series always keeps
ODD = "(state <> 0 OR value > 1e308 OR value < -1e308)"  # values a series always keeps


class Base(DeclarativeBase):
    pass


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    world_size: Mapped[int] = mapped_column(Integer)
    spec: Mapped[str] = mapped_column(Text)  # JSON: {"metrics": {...}, "derived": {...}}
    step_timeout_s: Mapped[float] = mapped_column(Double)
    created_at: Mapped[float] = mapped_column(Double)


class Metric(Base):
    """The append-only column index of a run's metrics."""

    __tablename__ = "metrics"

    run_id: Mapped[int] = mapped_column(ForeignKey(_RUN_FK, ondelete="CASCADE"), primary_key=True)
    col: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))

    __table_args__ = (Index("ix_metrics_run_name", "run_id", "name", unique=True),)


class Step(Base):
    """A step's state machine and, once finalised, its result."""

    __tablename__ = "steps"

    run_id: Mapped[int] = mapped_column(ForeignKey(_RUN_FK, ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    status: Mapped[str] = mapped_column(String(16))
    revision: Mapped[int] = mapped_column(Integer)
    committed_ranks: Mapped[int] = mapped_column(Integer)
    expected: Mapped[int] = mapped_column(BigInteger)
    received: Mapped[int] = mapped_column(BigInteger)
    missing_ranks: Mapped[int] = mapped_column(Integer)
    first_seen_at: Mapped[float] = mapped_column(Double)
    deadline: Mapped[float] = mapped_column(Double)
    finalised_at: Mapped[float | None] = mapped_column(Double)
    result: Mapped[str | None] = mapped_column(Text)  # JSON of StepResult

    __table_args__ = (
        Index("ix_steps_status_deadline", "status", "deadline"),
        Index("ix_steps_run_finalised", "run_id", "finalised_at", "step"),
        # covers the per-run status counts (runs list, run summary, /metrics) so they
        # never read the wide result column
        Index("ix_steps_run_status", "run_id", "status", "step", "missing_ranks"),
        Index(
            "ix_steps_run_revised",
            "run_id",
            "step",
            sqlite_where=text(REVISED),
            postgresql_where=text(REVISED),
        ),
    )


class StepValue(Base):
    """One finalised value of one metric (or derived value) of one step.

    ``state``: 0 a number (finite or infinite), 1 NaN, 2 undefined; ``value`` is NULL
    unless ``state`` is 0. Rewritten whenever the step is finalised again.

    A series reads one (run, col) range of the primary key, so the key holds the
    values: SQLite stores the table in key order (``WITHOUT ROWID``) and PostgreSQL's
    key index includes them (index-only scans). ``ix_step_values_odd`` finds the
    values a downsampled series always keeps.
    """

    __tablename__ = "step_values"

    run_id: Mapped[int] = mapped_column(Integer, autoincrement=False)
    col: Mapped[int] = mapped_column(Integer, autoincrement=False)
    step: Mapped[int] = mapped_column(BigInteger, autoincrement=False)
    value: Mapped[float | None] = mapped_column(Double)
    state: Mapped[int] = mapped_column(SmallInteger)

    __table_args__ = (
        PrimaryKeyConstraint("run_id", "col", "step", postgresql_include=["value", "state"]),
        Index(
            "ix_step_values_odd",
            "run_id",
            "col",
            "step",
            sqlite_where=text(ODD),
            postgresql_where=text(ODD),
        ),
        {"sqlite_with_rowid": False},
    )


class Commit(Base):
    __tablename__ = "commits"

    run_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    fragments: Mapped[int] = mapped_column(BigInteger)


#: PostgreSQL keeps a row's wide values in the row up to a page's worth (migration
#: 0010): a reporter's bundle (2 kB for 8 × 32 float64) and partial state stay inline
_ROWS_INLINE = {"postgresql_with": {"toast_tuple_target": 8160}}


class Fragment(Base):
    """Fragments as they arrived: a row is one fragment (``seqs`` null) or a *bundle* of
    several full-width fragments of one (step, rank) that one batch brought (``seqs``:
    their seqs as little-endian int64, ascending; ``values_f64``: their blobs in that
    order; keyed by the highest), so that a reporter's body is one row, not one per
    microbatch (:func:`steptally.service.domain.packing.bundled`)."""

    __tablename__ = "fragments"
    __table_args__ = (_ROWS_INLINE,)

    run_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    values_f64: Mapped[bytes] = mapped_column(LargeBinary)
    present: Mapped[bytes | None] = mapped_column(LargeBinary)
    tails: Mapped[bytes | None] = mapped_column(LargeBinary)  # exact sums' further terms
    seqs: Mapped[bytes | None] = mapped_column(LargeBinary)  # a bundle's seqs


class Partial(Base):
    """The exact partial state of the fragments stored for one (step, rank): what a
    finalisation merges instead of reading every fragment (see
    :mod:`steptally.service.domain.partial`). Every pair with fragments has one (ingest
    takes a pair without one to have none stored); a batch that brings new fragments of
    the pair merges them in while it holds the pair. ``fragments`` counts those the
    state holds: fewer than the pair's fragments only for fragments stored before
    partial rows existed, which a finalisation then reads themselves."""

    __tablename__ = "partials"
    __table_args__ = (_ROWS_INLINE,)

    run_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    fragments: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[bytes] = mapped_column(LargeBinary)


class Breach(Base):
    """A step that broke one of its run's alert rules: one row per (step, rule), written
    by the finalisation that first found it (a later revision that breaks the rule again
    leaves the row as it is). ``breach`` is the breach's JSON, as the step shows it."""

    __tablename__ = "breaches"

    run_id: Mapped[int] = mapped_column(ForeignKey(_RUN_FK, ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    rule: Mapped[str] = mapped_column(String(128), primary_key=True)
    revision: Mapped[int] = mapped_column(Integer)
    finalised_at: Mapped[float] = mapped_column(Double)
    breach: Mapped[str] = mapped_column(Text)

    __table_args__ = (Index("ix_breaches_run_rule", "run_id", "rule"),)


class AuthToken(Base):
    """A bearer token (``service/auth/tokens.py``): its scope, optional run, and only a
    hash of its secret. A revoked token keeps its row, with the time of revocation."""

    __tablename__ = "tokens"

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    secret_hash: Mapped[str] = mapped_column(String(64))
    scope: Mapped[str] = mapped_column(String(16))
    run: Mapped[str | None] = mapped_column(String(128))
    label: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[float] = mapped_column(Double)
    revoked_at: Mapped[float | None] = mapped_column(Double)
