"""The SQL schema as typed SQLAlchemy models; Alembic versions must match it.

Timestamps are Unix seconds (float64), identical on SQLite and PostgreSQL. A
fragment is one row: its values are one blob of little-endian float64 over the
run's metric columns (``metrics.col``), see :mod:`steptally.service.domain.cells`.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Double, ForeignKey, Index, Integer, LargeBinary, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

_RUN_FK = "runs.id"


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

    __table_args__ = (Index("ix_steps_status_deadline", "status", "deadline"),)


class Commit(Base):
    __tablename__ = "commits"

    run_id: Mapped[int] = mapped_column(ForeignKey(_RUN_FK, ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    fragments: Mapped[int] = mapped_column(BigInteger)


class Fragment(Base):
    __tablename__ = "fragments"

    run_id: Mapped[int] = mapped_column(ForeignKey(_RUN_FK, ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    values_f64: Mapped[bytes] = mapped_column(LargeBinary)
    present: Mapped[bytes | None] = mapped_column(LargeBinary)
