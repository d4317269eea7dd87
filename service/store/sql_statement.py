"""Every statement of the ingest and finalise path, once per dialect, built at import.

* :class:`Statements`: SQLAlchemy Core statements, built once per dialect's
  ``INSERT`` construct (:func:`core`) and reused, which keeps SQLAlchemy's compile
  cache warm. Sets of steps and ranks are ``IN`` lists of expanding parameters
  (``:steps``, ``:ranks``), filtered exactly in Python.
* :data:`PIPELINE`: PostgreSQL's pipelined path (:mod:`.sql_postgres`) sends driver
  text, generated here from the same tables: arrays (``unnest``, ``= ANY``) keep each
  text fixed whatever the batch size, so psycopg prepares it once per connection.
  Each parameter is bound in binary and cast to its column's type, and values
  (``'open'`` included) are bound, never spelled in the text.
* :data:`SQLITE`: SQLite's path (:class:`~.dialect.SqliteDialect`) through the driver,
  one statement for each read and each table's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from sqlalchemy import Column, Table, bindparam, select
from sqlalchemy.dialects import postgresql

from steptally.service.domain.progress import StepStatus
from steptally.service.store.models import (
    Breach,
    Commit,
    Fragment,
    Metric,
    Partial,
    Run,
    Step,
    StepValue,
)  # fmt: skip

STEPS: Table = Step.__table__  # type: ignore[assignment]
COMMITS: Table = Commit.__table__  # type: ignore[assignment]
FRAGMENTS: Table = Fragment.__table__  # type: ignore[assignment]
STEP_VALUES: Table = StepValue.__table__  # type: ignore[assignment]
PARTIALS: Table = Partial.__table__  # type: ignore[assignment]
BREACHES: Table = Breach.__table__  # type: ignore[assignment]
RUNS: Table = Run.__table__  # type: ignore[assignment]
METRICS: Table = Metric.__table__  # type: ignore[assignment]
STEP_FIELDS = (
    "status", "revision", "committed_ranks", "expected", "received", "missing_ranks",
    "finalised_at", "result",
)  # fmt: skip  # what a batch or a finalisation changes in a step row
# every column of a step row but run_id, each an attribute of StepState
STATE_COLUMNS = tuple(c.name for c in STEPS.c if c.name != "run_id")


@dataclass(frozen=True)
class Statements:
    """What the ingest path's shared code (duplicates, finalisation) runs as Core."""

    fragments_of: Any  # (step, rank, seq, values, present, tails, seqs): :run, :steps, :ranks
    insert_breaches: Any  # breaches rows; a (step, rule) already stored stays as it is


def _where(table: Table) -> Any:
    return (
        table.c.run_id == bindparam("run"),
        table.c.step.in_(bindparam("steps", expanding=True)),
        table.c.rank.in_(bindparam("ranks", expanding=True)),
    )


def core(insert: Callable[[Table], Any]) -> Statements:
    """The statements over a dialect's ``insert`` (``sqlite.insert``, ``postgresql.insert``)."""
    f = FRAGMENTS.c
    return Statements(
        fragments_of=select(f.step, f.rank, f.seq, f.values_f64, f.present, f.tails, f.seqs).where(
            *_where(FRAGMENTS)
        ),
        insert_breaches=insert(BREACHES).on_conflict_do_nothing(),
    )


def keys_params(run_id: int, keys: Any) -> dict[str, Any]:
    """Parameters selecting the steps and ranks of ``keys`` (tuples starting step, rank),
    for :attr:`Statements.commits_of` and the like, and their :data:`PIPELINE` texts."""
    keys = list(keys)
    return {
        "run": run_id,
        "steps": sorted({k[0] for k in keys}),
        "ranks": sorted({k[1] for k in keys}),
    }


# -- PostgreSQL's driver text -----------------------------------------------------------


_POSTGRES = postgresql.dialect()  # type: ignore[no-untyped-call]


def _type(column: Column[Any]) -> str:
    return str(column.type.compile(dialect=_POSTGRES))


def _param(column: Column[Any], name: str | None = None) -> str:
    return f"%({name or column.name})b::{_type(column)}"


def _array(column: Column[Any], name: str | None = None) -> str:
    return f"%({name or column.name})b::{_type(column)}[]"


def _names(columns: Sequence[Column[Any]]) -> str:
    return ", ".join(c.name for c in columns)


def _unnest_insert(
    table: Table,
    conflict: str = "",
    returning: Sequence[str] = (),
    prefix: str = "",
    where: str = "",
) -> str:
    """``INSERT`` of many rows of one run: ``%(run_id)s`` once, every other column an
    array parameter named after it (after ``prefix``); ``where``: only if it holds."""
    rest = ", ".join(_array(c, prefix + c.name) for c in table.c if c.name != "run_id")
    text = (
        f"INSERT INTO {table.name} ({_names(list(table.c))}) "
        f"SELECT {_param(table.c.run_id)}, * FROM unnest({rest})"
    )
    text += f" WHERE {where}" if where else ""
    text += f" ON CONFLICT {conflict}" if conflict else ""
    return text + (f" RETURNING {', '.join(returning)}" if returning else "")


_UPSERT_PARTIALS = (
    "(run_id, step, rank) DO UPDATE SET fragments = excluded.fragments, state = excluded.state"
)


def _apply() -> str:
    """A batch's writes as ONE statement: its new fragments rows (``%(f_<column>)s``),
    its new commits (``%(c_<column>)s``) and its partial rows (``%(p_<column>)s``) in
    data-modifying ``WITH`` clauses (each runs once, whole, empty arrays inserting
    nothing), then :func:`_add_to_steps`, whose rows it returns."""
    return (
        f"WITH f AS ({_unnest_insert(FRAGMENTS, prefix='f_')}), "
        f"c AS ({_unnest_insert(COMMITS, prefix='c_')}), "
        f"p AS ({_unnest_insert(PARTIALS, _UPSERT_PARTIALS, prefix='p_')}) "
        f"{_add_to_steps()}"
    )


def _fresh() -> str:
    """A batch's writes as ONE statement when nothing is stored of any of its (step,
    rank) pairs (``%(k_step)s`` and ``%(k_rank)s`` side by side: no commit, no partial
    row, so no fragment either) and none of its steps (``%(step)s``) is finalised (has
    a status of ``%(finalised)s``): the writes of :func:`_apply`, each made only if
    that holds, and whether it did (``ok``) beside the steps' rows (nulls when it did
    not: then it wrote nothing). Each pair is looked up by its key behind ``OFFSET 0``,
    as in :func:`_pairs_of`, and each step by run, status and step, once for each
    status of a finalised step: whichever of the steps' two indexes a plan made once
    takes, a lookup is bounded (by run and step alone, or with the statuses as an
    array, a plan made on empty tables took the status index and read the run's every
    step). The steps' update reads the inserts' counts, so that they run before it and
    its rows are locked last: PostgreSQL runs a data-modifying ``WITH`` that the
    statement's result reads before the others, which held a step's row through every
    insert and kept two groups of one step from writing side by side."""
    run = _param(STEPS.c.run_id)

    def found(table: Table) -> str:
        return (
            f"EXISTS (SELECT 1 FROM {table.name} AS x WHERE x.run_id = {run} "
            "AND x.step = p.step AND x.rank = p.rank OFFSET 0)"
        )

    pairs = f"unnest({_array(STEPS.c.step, 'k_step')}, {_array(COMMITS.c.rank, 'k_rank')})"
    finalised = (
        f"unnest({_array(STEPS.c.step, 'step')}) AS q(step), "
        f"unnest({_array(STEPS.c.status, 'finalised')}) AS d(status)"
    )
    ok = (
        f"SELECT NOT EXISTS (SELECT 1 FROM {finalised} WHERE EXISTS (SELECT 1 FROM steps AS x "
        f"WHERE x.run_id = {run} AND x.status = d.status AND x.step = q.step OFFSET 0)) "
        f"AND NOT EXISTS (SELECT 1 FROM {pairs} AS p(step, rank) "
        f"WHERE {found(COMMITS)} OR {found(PARTIALS)}) AS ok"
    )
    only = "(SELECT ok FROM ok)"
    inserted = " + ".join(f"(SELECT count(*) FROM {t})" for t in ("f", "c", "p"))
    return (
        f"WITH ok AS ({ok}), "
        f"f AS ({_unnest_insert(FRAGMENTS, prefix='f_', where=only, returning=['1'])}), "
        f"c AS ({_unnest_insert(COMMITS, prefix='c_', where=only, returning=['1'])}), "
        f"p AS ({_unnest_insert(PARTIALS, prefix='p_', where=only, returning=['1'])}), "
        f"s AS ({_add_to_steps(where=f'{only} AND {inserted} >= 0')}) "
        "SELECT ok.ok, s.* FROM ok LEFT JOIN s ON true"
    )


LOCK_PAIRS = "SELECT pg_advisory_xact_lock(k) FROM unnest(%(keys)b::BIGINT[]) AS k"

#: the error of :func:`_fresh_plain` where a step is finalised (``steptally_refuse``,
#: migration 0011, raises it with the SQLSTATE ``ST001``)
REFUSED_FINALISED = "a step of this group is finalised: the group is stored the general way"
#: the error of :func:`_finalise_fresh` where the step or the run is not as the
#: finalisation took it
REFUSED_CHANGED = (
    "a step this group completed, or its run, changed before its finalisation: the group "
    "is stored the general way"
)


def _fresh_plain() -> str:
    """:func:`_fresh` for a batch whose pairs are all plain
    (:meth:`~steptally.service.domain.batch.PreparedBatch.is_plain`: each one committed
    and every fragment of it in the batch, so each has a commits and a partials row to
    insert), without looking anything up first: each row is inserted as it is, so a
    pair with a commit or a partial row stored breaks that table's key and the
    statement fails; a step stored with another status than ``%(open)s`` keeps its row
    as it was and, missing from the steps' update, makes the statement fail too
    (``steptally_refuse``, SQLSTATE ``ST001``). Failing, it writes nothing; otherwise it
    returns what :func:`_fresh` returns, ``ok`` true. The lookups of :func:`_fresh`
    cost the database ~25 % of a group of 8 bodies' CPU (bench/README.md, Scale),
    where the tables' keys check the same on their own.

    It takes its pairs' locks itself (``%(keys)s``, as ``lock_pairs`` takes them),
    before any insert: it reads nothing through its snapshot (a key's check and the
    steps' upsert see the rows committed last, whoever committed them while it waited),
    so the locks need no statement of their own. The steps' update reads the inserts'
    counts, as in :func:`_fresh`, so that its rows are locked last."""
    locked = "(SELECT count(*) FROM l) >= 0"
    inserted = " + ".join(f"(SELECT count(*) FROM {t})" for t in ("f", "c", "p"))
    steps = _array(STEPS.c.step, "step")
    refuse = f"steptally_refuse({_param(STEPS.c.result, 'refused')})"

    def insert(table: Table, prefix: str) -> str:
        return _unnest_insert(table, prefix=prefix, where=locked, returning=["1"])

    return (
        f"WITH l AS ({LOCK_PAIRS}), "
        f"f AS ({insert(FRAGMENTS, 'f_')}), "
        f"c AS ({insert(COMMITS, 'c_')}), "
        f"p AS ({insert(PARTIALS, 'p_')}), "
        f"s AS ({_add_to_steps(where=f'{inserted} >= 0', only_open=True)}), "
        f"g AS (SELECT CASE WHEN (SELECT count(*) FROM s) < cardinality({steps}) "
        f"THEN {refuse} ELSE true END AS ok) "
        "SELECT g.ok, s.* FROM g LEFT JOIN s ON true"
    )


def _finalise_fresh() -> str:
    """A step that a group of plain pairs completed on its own, finalised in the same
    transaction (:func:`~.sql_ingest.finalise_fresh`): its row's fields of
    :data:`STEP_FIELDS` set as :data:`PIPELINE` ``update_step`` sets them, provided that
    the row is the one the group's ``fresh_plain`` made — open, never finalised, first
    seen at ``%(first_seen_at)s`` and counting exactly the group's own ranks and
    fragments — and that the run is as the finalisation read it (``%(spec)s``,
    ``%(world_size)s``, ``%(step_timeout_s)s`` and ``%(columns)s`` metric columns, what
    :class:`~.sql_run.KnownRuns` compares). Otherwise it fails (``steptally_refuse``,
    SQLSTATE ``ST001``), the whole transaction with it, and the group is stored the
    general way."""
    c, r = STEPS.c, RUNS.c
    run = _param(c.run_id)
    own_row = " AND ".join(
        [
            f"run_id = {run}",
            f"step = {_param(c.step)}",
            f"status = {_param(c.status, 'open')}",
            "revision = 0",
            "finalised_at IS NULL",
            f"first_seen_at = {_param(c.first_seen_at)}",
            *(f"{n} = {_param(c[n])}" for n in ("committed_ranks", "expected", "received")),
        ]
    )
    sets = ", ".join(f"{n} = {_param(c[n])}" for n in STEP_FIELDS)
    columns = f"(SELECT count(*) FROM {METRICS.name} WHERE run_id = {run})"
    same_run = (
        f"SELECT spec = {_param(r.spec)} AND world_size = {_param(r.world_size)} "
        f"AND step_timeout_s = {_param(r.step_timeout_s)} AND {columns} = %(columns)b::BIGINT "
        f"FROM {RUNS.name} WHERE id = {run}"
    )
    refuse = f"steptally_refuse({_param(STEPS.c.result, 'refused')})"
    return (
        f"WITH u AS (UPDATE steps SET {sets} WHERE {own_row} RETURNING 1) "
        f"SELECT CASE WHEN (SELECT count(*) FROM u) = 1 AND coalesce(({same_run}), false) "
        f"THEN true ELSE {refuse} END"
    )


def pairs_params(run_id: int, pairs: Any) -> dict[str, Any]:
    """Parameters naming exactly the (step, rank) ``pairs``, for the :data:`PIPELINE`
    reads of pairs: ``%(run)s``, and ``%(step)s`` and ``%(rank)s`` side by side."""
    ordered = sorted(pairs)
    return {"run": run_id, "step": [p[0] for p in ordered], "rank": [p[1] for p in ordered]}


_PAIRS = (
    f"unnest({_array(STEPS.c.step, 'step')}, {_array(COMMITS.c.rank, 'rank')}) AS p(step, rank)"
)


def _pairs_of() -> str:
    """What a batch's probe reads of each (step, rank) pair of :func:`pairs_params`, in
    one statement, one key lookup a table (``LATERAL``: a join would plan for a hundred
    pairs and read whole tables; ``OFFSET 0`` keeps the planner from turning the lookups
    back into joins, which a plan made once for any pairs did: it hashed every commit
    and partial row of the run): the fragments its commit declared, its partial row's
    fragments and state, and the key seq and seqs of each of its fragments rows (two
    arrays in key order); nulls where it has none."""

    def pair(t: str) -> str:
        run = _param(STEPS.c.run_id, "run")
        return f"{t}.run_id = {run} AND {t}.step = p.step AND {t}.rank = p.rank"

    return (
        "SELECT p.step, p.rank, c.fragments, t.fragments, t.state, f.keys, f.bundles "
        f"FROM {_PAIRS} "
        f"LEFT JOIN LATERAL (SELECT fragments FROM commits AS c WHERE {pair('c')} OFFSET 0) "
        "AS c ON true "
        "LEFT JOIN LATERAL (SELECT fragments, state FROM partials AS t "
        f"WHERE {pair('t')} OFFSET 0) AS t ON true "
        "LEFT JOIN LATERAL (SELECT array_agg(f.seq ORDER BY f.seq) AS keys, "
        "array_agg(f.seqs ORDER BY f.seq) AS bundles FROM fragments AS f "
        f"WHERE t.fragments IS NOT NULL AND {pair('f')}) AS f ON true"
    )


def _add_to_steps(where: str = "", only_open: bool = False) -> str:
    """Add each step's counters (``%(received)s``, ``%(committed)s``, ``%(expected)s``,
    one array each, in step order) to its row, creating it as a new step first
    (``%(world_size)s`` and the other columns of a new step as parameters); locks the
    rows in step order and returns them as they now stand. ``where``: only if it
    holds. ``only_open``: a row stored with another status than ``%(open)s`` is left
    as it is, and not returned."""
    new = {
        "run_id": _param(STEPS.c.run_id),
        "step": "d.step",
        "committed_ranks": "d.committed",
        "expected": "d.expected",
        "received": "d.received",
        "missing_ranks": f"{_param(STEPS.c.missing_ranks, 'world_size')} - d.committed",
    }
    values = [new.get(c.name, _param(c)) for c in STEPS.c]
    arrays = ", ".join(
        _array(STEPS.c[column], name)
        for name, column in (
            ("step", "step"),
            ("received", "received"),
            ("committed", "committed_ranks"),
            ("expected", "expected"),
        )
    )
    added = ", ".join(
        f"{c} = steps.{c} + excluded.{c}" for c in ("committed_ranks", "expected", "received")
    )
    return (
        f"INSERT INTO steps ({_names(list(STEPS.c))}) SELECT {', '.join(values)} "
        f"FROM unnest({arrays}) AS d(step, received, committed, expected) "
        f"{f'WHERE {where} ' if where else ''}ORDER BY d.step "
        f"ON CONFLICT (run_id, step) DO UPDATE SET {added}, "
        "missing_ranks = steps.missing_ranks - excluded.committed_ranks "
        + (f"WHERE steps.status = {_param(STEPS.c.status, 'open')} " if only_open else "")
        + f"RETURNING {_names(list(STEPS.c))}"
    )


def pair_lock_key(run_id: int, step: int, rank: int) -> int:
    """A (step, rank) pair's key for PostgreSQL's advisory locks: a signed 64-bit mix of
    the three, the same in every process and release (two pairs that share one only
    wait on each other)."""
    mixed = (
        (run_id * 0x9E3779B97F4A7C15) ^ (step * 0xC2B2AE3D27D4EB4F) ^ (rank * 0x165667B19E3779F9)
    )
    mixed &= (1 << 64) - 1
    return mixed - (1 << 64) if mixed >> 63 else mixed


@dataclass(frozen=True)
class PipelineText:
    lock_pairs: str  # %(keys)s: the pairs' lock keys (:func:`pair_lock_key`), sorted
    steps_of: str  # %(run)s, %(steps)s: every column of those step rows, unlocked
    locked_steps_of: str  # the same rows, locked in step order
    add_to_steps: str  # %(run_id)s, a new step's columns and an array per counter
    apply: str  # a batch's writes: _apply
    fresh: str  # a batch's writes when nothing of its pairs is stored: _fresh
    fresh_plain: str  # the same for a batch of plain pairs, failing if it does not hold
    pairs_of: str  # pairs_params: (step, rank, declared, fragments, state, keys, bundles)
    finalise_fresh: str  # a step a fresh_plain group completed, finalised: _finalise_fresh
    upsert_values: str  # %(run_id)s and an array per step_values column
    insert_values: str  # the same, for steps with none stored (no conflict to look for)
    update_step: str  # %(run_id)s, %(step)s and a value per column of STEP_FIELDS
    partials_of_step: str  # %(run)s, %(step)s: (rank, fragments, state) of its partial rows
    commits_of_step: str  # %(run)s, %(step)s: (rank, fragments) of its commits
    run_key: str  # %(run)s: what of the run can change (sql_run's KnownRuns compares it)
    copy_fragments: str  # COPY of fragments rows, every column, binary
    copy_types: tuple[str, ...]  # their types, for the binary COPY


def _of_step(table: Table, *columns: str) -> str:
    c = table.c
    return (
        f"SELECT {', '.join(columns)} FROM {table.name} "
        f"WHERE run_id = {_param(c.run_id, 'run')} AND step = {_param(c.step, 'step')}"
    )


_value_keys = ", ".join(c.name for c in STEP_VALUES.primary_key)
_value_rest = [c.name for c in STEP_VALUES.c if not c.primary_key]

_STEPS_OF = (
    f"SELECT {_names(list(STEPS.c))} FROM steps WHERE run_id = {_param(STEPS.c.run_id, 'run')} "
    f"AND step = ANY({_array(STEPS.c.step, 'steps')})"
)

PIPELINE = PipelineText(
    lock_pairs=LOCK_PAIRS,
    steps_of=_STEPS_OF,
    locked_steps_of=f"{_STEPS_OF} ORDER BY step FOR UPDATE",
    add_to_steps=_add_to_steps(),
    apply=_apply(),
    fresh=_fresh(),
    fresh_plain=_fresh_plain(),
    pairs_of=_pairs_of(),
    finalise_fresh=_finalise_fresh(),
    upsert_values=_unnest_insert(
        STEP_VALUES,
        f"({_value_keys}) DO UPDATE SET " + ", ".join(f"{c} = excluded.{c}" for c in _value_rest),
    ),
    insert_values=_unnest_insert(STEP_VALUES),
    update_step=(
        f"UPDATE steps SET {', '.join(f'{n} = {_param(STEPS.c[n])}' for n in STEP_FIELDS)} "
        f"WHERE run_id = {_param(STEPS.c.run_id)} AND step = {_param(STEPS.c.step)}"
    ),
    partials_of_step=_of_step(PARTIALS, "rank", "fragments", "state"),
    commits_of_step=_of_step(COMMITS, "rank", "fragments"),
    run_key=(
        f"SELECT spec, world_size, step_timeout_s, (SELECT count(*) FROM {METRICS.name} "
        f"WHERE run_id = {_param(METRICS.c.run_id, 'run')}) FROM {RUNS.name} "
        f"WHERE id = {_param(RUNS.c.id, 'run')}"
    ),
    copy_fragments=(
        f"COPY {FRAGMENTS.name} ({_names(list(FRAGMENTS.c))}) FROM STDIN (FORMAT BINARY)"
    ),
    copy_types=tuple(_type(c) for c in FRAGMENTS.c),
)


# -- SQLite's driver text -----------------------------------------------------------------


def _in_json(column: str) -> str:
    return f"{column} IN (SELECT value FROM json_each(?))"


@dataclass(frozen=True)
class RowsInsert:
    """An ``INSERT`` of any number of rows as ONE statement (``VALUES (...), (...)``):
    the driver steps a statement once, where ``executemany`` steps it (and lets go of
    the GIL) once a row. :meth:`text` is the statement for ``n`` rows."""

    table: str
    columns: int
    head: str
    tail: str

    def text(self, n: int) -> str:
        return _rows_text(self.head, self.columns, n, self.tail)


@cache
def _rows_text(head: str, columns: int, n: int, tail: str) -> str:
    row = "(" + ", ".join("?" * columns) + ")"
    return head + ", ".join([row] * n) + tail


def _rows_insert(table: Table, conflict: str = "") -> RowsInsert:
    return RowsInsert(
        table.name,
        len(table.c),
        f"INSERT INTO {table.name} ({_names(list(table.c))}) VALUES ",
        conflict,
    )


@dataclass(frozen=True)
class SqliteText:
    """SQLite's ingest path (:class:`~.dialect.SqliteDialect`), sent through the driver:
    ``?`` parameters, a set of numbers as one JSON array (``json_each``), so that each
    read stays one prepared statement whatever the batch. The reads take the run id
    and JSON arrays of steps (and ranks, and seqs); the writes are :class:`RowsInsert`."""

    stored_of: str  # run, steps, run, steps, ranks, run, steps, ranks: see _stored_of
    fragment_keys_of: str  # run, steps, ranks: step, rank, seq, seqs
    insert_fragments: RowsInsert
    insert_commits: RowsInsert
    upsert_partials: RowsInsert
    upsert_steps: RowsInsert  # step rows; a stored one takes the row's counters
    insert_partials: RowsInsert  # a plain write's partial rows: one stored breaks the key
    # a plain write's new step rows; a stored open one gains their counters, one of
    # another status stays as it was; returns the rows it wrote, as they now stand
    add_to_steps: RowsInsert
    upsert_values: RowsInsert  # step_values rows, replacing a step's earlier values
    insert_values: RowsInsert  # step_values rows of steps with none stored
    # run, step, run, step: (0, rank, fragments, state) of its partial rows, then
    # (1, rank, fragments, NULL) of its commits
    parts_of_step: str
    run_key: str  # run, run: what of the run can change (sql_run's KnownRuns compares it)
    update_step: str  # STEP_FIELDS, then run and step


_of = f"run_id = ? AND {_in_json('step')} AND {_in_json('rank')}"
_counters = ("committed_ranks", "expected", "received", "missing_ranks")


def _stored_of() -> str:
    """What a batch's probe reads, as ONE statement (the driver lets go of the GIL once
    for it, not three times): the batch's step rows (``0``, then every column), and the
    partial rows (``1``, step, rank, fragments, state) and commits (``2``, step, rank,
    fragments) of its steps × ranks, each padded with nulls to the step rows' width."""
    width = len(STEPS.c)
    parts, commits = ", NULL" * (width - 4), ", NULL" * (width - 3)
    return (
        f"SELECT 0, {_names(list(STEPS.c))} FROM steps WHERE run_id = ? AND {_in_json('step')} "
        f"UNION ALL SELECT 1, step, rank, fragments, state{parts} FROM partials WHERE {_of} "
        f"UNION ALL SELECT 2, step, rank, fragments{commits} FROM commits WHERE {_of}"
    )


SQLITE = SqliteText(
    stored_of=_stored_of(),
    fragment_keys_of=f"SELECT step, rank, seq, seqs FROM fragments WHERE {_of}",
    insert_fragments=_rows_insert(FRAGMENTS),
    insert_commits=_rows_insert(COMMITS),
    upsert_partials=_rows_insert(
        PARTIALS,
        " ON CONFLICT (run_id, step, rank) DO UPDATE SET "
        "fragments = excluded.fragments, state = excluded.state",
    ),
    upsert_steps=_rows_insert(
        STEPS,
        " ON CONFLICT (run_id, step) DO UPDATE SET "
        + ", ".join(f"{c} = excluded.{c}" for c in _counters),
    ),
    insert_partials=_rows_insert(PARTIALS),
    add_to_steps=_rows_insert(
        STEPS,
        " ON CONFLICT (run_id, step) DO UPDATE SET "
        + ", ".join(f"{c} = {c} + excluded.{c}" for c in _counters[:3])
        + ", missing_ranks = missing_ranks - excluded.committed_ranks"
        + f" WHERE status = '{StepStatus.OPEN.value}' RETURNING {_names(list(STEPS.c))}",
    ),
    upsert_values=_rows_insert(
        STEP_VALUES,
        f" ON CONFLICT ({_value_keys}) DO UPDATE SET "
        + ", ".join(f"{c} = excluded.{c}" for c in _value_rest),
    ),
    insert_values=_rows_insert(STEP_VALUES),
    parts_of_step=(
        "SELECT 0, rank, fragments, state FROM partials WHERE run_id = ? AND step = ? "
        "UNION ALL SELECT 1, rank, fragments, NULL FROM commits WHERE run_id = ? AND step = ?"
    ),
    run_key=(
        f"SELECT spec, world_size, step_timeout_s, (SELECT count(*) FROM {METRICS.name} "
        f"WHERE run_id = ?) FROM {RUNS.name} WHERE id = ?"
    ),
    update_step=(
        f"UPDATE steps SET {', '.join(f'{n} = ?' for n in STEP_FIELDS)} "
        "WHERE run_id = ? AND step = ?"
    ),
)
