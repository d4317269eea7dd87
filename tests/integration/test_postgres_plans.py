"""PostgreSQL's ingest reads look each step and each (step, rank) pair up by its key,
whatever the tables held when the plan was made.

A writer's connection plans each statement once (``plan_cache_mode =
force_generic_plan``): PostgreSQL otherwise planned the pipeline's statements anew at
every execution, a fifth of its CPU a body at 256 ranks, because a plan made for the
actual arrays always looked cheaper than the generic one. A generic plan knows no
parameter, so the pairs read is written so that it can only be key lookups: its
subqueries behind ``OFFSET 0`` (a generic plan of the plain joins hashed every commit and
partial row of the run); the steps read, whose generic plan may take the steps' status
index, is planned for its arrays each time. And no plan reads a table sequentially
(``enable_seqscan = off``): a plan made while a run's tables were empty would otherwise
stay for the connection's life and, at 4096 ranks, read whole tables for every pair
(bench/README.md, Scale).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from steptally.service.app import create_app
from steptally.service.settings import Settings
from steptally.service.store import pg_pipeline
from steptally.service.store.dialect import dialect_for
from steptally.service.store.engine import make_engine
from steptally.service.store.sql_postgres import FINALISED
from steptally.service.store.sql_statement import (
    PIPELINE,
    REFUSED_FINALISED,
    pair_lock_key,
    pairs_params,
)

pytestmark = pytest.mark.postgres

RANKS = 256


def _fill(driver: psycopg.Connection, steps: int) -> None:
    """``steps`` steps of runs 1 and 2, every rank committed, with a partial row and a
    fragments row each (what a run's tables hold after a while)."""
    for run in (1, 2):
        driver.execute(
            "INSERT INTO steps (run_id, step, status, revision, committed_ranks, expected, "
            "received, missing_ranks, first_seen_at, deadline) "
            "SELECT %s, s, 'complete', 1, %s, 8 * %s, 8 * %s, 0, 0, 60 "
            "FROM generate_series(0, %s - 1) AS s",
            (run, RANKS, RANKS, RANKS, steps),
        )
        for table, extra, values in (
            ("commits", "fragments", "8"),
            ("partials", "fragments, state", "8, '\\x00'::bytea"),
            ("fragments", "seq, values_f64", "0, '\\x00'::bytea"),
        ):
            driver.execute(
                f"INSERT INTO {table} (run_id, step, rank, {extra}) "
                f"SELECT %s, s, r, {values} "
                "FROM generate_series(0, %s - 1) AS s, generate_series(0, %s - 1) AS r",
                (run, steps, RANKS),
            )


@pytest.fixture(params=[0, 24], ids=["empty tables", "a run's worth of rows"])
def writer(postgres_url: str, request: pytest.FixtureRequest) -> Iterator[psycopg.Connection]:
    """A writer's connection, set up as the store sets it up, over analysed tables that
    are empty (what a new database's first batches meet) or hold two runs' rows."""
    from tests.integration.conftest import _empty

    _empty(postgres_url)
    engine = make_engine(postgres_url)
    try:
        with engine.connect() as conn:
            driver = conn.connection.driver_connection
            assert isinstance(driver, psycopg.Connection)
            for run in (1, 2):
                driver.execute(
                    "INSERT INTO runs (id, name, world_size, spec, step_timeout_s, created_at) "
                    "VALUES (%s, %s, %s, '{}', 60, 0)",
                    (run, f"r{run}", RANKS),
                )
            _fill(driver, request.param)
            driver.execute("ANALYZE")
            driver.commit()
            dialect_for(engine).writer_connection(conn)
            yield driver
            driver.rollback()
    finally:
        engine.dispose()


def _generic_plan(
    driver: psycopg.Connection, text: str, names: tuple[str, ...], args: tuple[Any, ...]
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """``text`` prepared as the writer's connection prepares it (its plan then made once,
    for any parameters): the plan and the rows for ``args``."""
    for i, name in enumerate(names, start=1):
        text = text.replace(f"%({name})b", f"${i}")
    assert not re.search(r"%\(\w+\)b", text), text
    driver.execute("SET plan_cache_mode = force_generic_plan")  # as a writer's, whatever it is
    driver.execute(f"PREPARE probe_read AS {text}")
    try:
        literal = psycopg.ClientCursor(driver)  # EXPLAIN EXECUTE takes no bound parameters
        call = f"probe_read({', '.join(['%s'] * len(args))})"
        plan = [r[0] for r in literal.execute(f"EXPLAIN EXECUTE {call}", args)]
        rows = literal.execute(f"EXECUTE {call}", args).fetchall()
    finally:
        driver.execute("DEALLOCATE probe_read")
    return plan, rows


def _scans(plan: list[str]) -> list[tuple[str, str]]:
    """Every table or index a plan reads: (how, the index it names, else the table)."""
    out = []
    for line in plan:
        found = re.search(
            r"((?:Bitmap Heap|Bitmap Index|Index Only|Index|Seq) Scan)(?: using (\S+))? on (\S+)",
            line,
        )
        if found:
            out.append((found[1], found[2] or found[3]))
    return out


def test_a_writer_plans_its_statements_once_and_never_sequentially(
    writer: psycopg.Connection,
) -> None:
    assert writer.execute("SHOW plan_cache_mode").fetchone() == ("force_generic_plan",)
    assert writer.execute("SHOW enable_seqscan").fetchone() == ("off",)


def test_the_pairs_read_is_one_key_lookup_a_table_in_its_generic_plan(
    writer: psycopg.Connection,
) -> None:
    params = pairs_params(1, [(3, 5), (3, 6), (7, 255)])
    plan, rows = _generic_plan(
        writer,
        PIPELINE.pairs_of,
        ("step", "rank", "run"),
        (params["step"], params["rank"], params["run"]),
    )
    assert sorted(tuple(r[:2]) for r in rows) == [(3, 5), (3, 6), (7, 255)]
    assert sorted(_scans(plan)) == [
        ("Index Scan", "commits_pkey"),
        ("Index Scan", "fragments_pkey"),
        ("Index Scan", "partials_pkey"),
    ], plan
    assert not [line for line in plan if "Hash" in line or "Merge" in line], plan


def _fresh_args(steps: list[int], pairs: list[tuple[int, int]]) -> dict[str, Any]:
    """The fresh write's parameters for ``pairs`` and ``steps`` of run 1, each step
    gaining one fragment received, bringing no fragment, commit or partial row."""
    return {
        "run_id": 1, "k_step": [s for s, _ in pairs], "k_rank": [r for _, r in pairs],
        "step": steps, "status": "open", "revision": 0,
        "world_size": RANKS, "first_seen_at": 0.0, "deadline": 60.0, "finalised_at": None,
        "result": None, "received": [1] * len(steps), "committed": [0] * len(steps),
        "expected": [0] * len(steps), "finalised": FINALISED,
        **{f"f_{c}": [] for c in ("step", "rank", "seq", "values_f64", "present", "tails", "seqs")},
        **{f"c_{c}": [] for c in ("step", "rank", "fragments")},
        **{f"p_{c}": [] for c in ("step", "rank", "fragments", "state")},
    }  # fmt: skip


def test_the_fresh_write_looks_each_pair_and_step_up_by_its_key_in_its_generic_plan(
    writer: psycopg.Connection,
) -> None:
    """The one-round-trip write checks that nothing of its pairs is stored and none of
    its steps finalised by key lookups, whatever the tables held when it was planned;
    with a run's worth of rows (every step complete, every pair committed) it finds that
    and writes nothing."""
    names = tuple(dict.fromkeys(re.findall(r"%\((\w+)\)b", PIPELINE.fresh)))
    args = _fresh_args([3, 7], [(3, 5), (3, 6), (7, 255)])
    plan, rows = _generic_plan(writer, PIPELINE.fresh, names, tuple(args[n] for n in names))
    reads = dict((index, how) for how, index in _scans(plan))
    assert reads.keys() - {"steps_pkey", "ix_steps_run_status"} == {
        "commits_pkey",
        "partials_pkey",
    }, "\n".join(plan)
    steps = [i for i, line in enumerate(plan) if " Scan " in line and " on steps " in line]
    assert len(steps) == 1, plan
    # whichever index: each column before the step bounded (the status index: the status)
    bounds = ["run_id = ", "step = q.step"] + ["status = "] * (
        "ix_steps_run_status" in plan[steps[0]]
    )
    cond = plan[steps[0] + 1]
    assert "Index Cond" in cond and all(b in cond for b in bounds), "\n".join(plan)
    assert not [line for line in plan if "Hash" in line or "Merge" in line], plan
    filled = writer.execute("SELECT count(*) FROM commits").fetchone() != (0,)
    if filled:
        assert [tuple(r[:3]) for r in rows] == [(False, None, None)]
    else:
        assert sorted((r[0], r[1], r[2]) for r in rows) == [(True, 1, 3), (True, 1, 7)]


def test_the_fresh_write_finds_a_finalised_step_or_a_stored_pair_and_writes_nothing(
    writer: psycopg.Connection,
) -> None:
    """Steps 100 (open) and 101 (partial), beyond what the tables hold: a batch that
    touches the partial step, or a pair with a commit stored, changes nothing; one of
    a new pair of the open step adds to its counters."""
    writer.execute(
        "INSERT INTO steps (run_id, step, status, revision, committed_ranks, expected, "
        "received, missing_ranks, first_seen_at, deadline) VALUES (1, 100, 'open', 0, 0, 0, "
        "0, %(n)s, 0, 60), (1, 101, 'partial', 1, 0, 0, 0, %(n)s, 0, 60)",
        {"n": RANKS},
    )
    received = "SELECT step, received FROM steps WHERE step >= 100 ORDER BY step"
    before = writer.execute(received).fetchall()
    for steps, pairs in (
        ([100, 101], [(100, 5), (101, 5)]),  # the partial step
        ([100], [(100, 5), (100, 6)]),  # (100, 6) has its commit stored
    ):
        if len(steps) == 1:
            writer.execute("INSERT INTO commits VALUES (1, 100, 6, 8)")
        args = _fresh_args(steps, pairs)
        rows = writer.execute(PIPELINE.fresh, args).fetchall()
        assert [tuple(r[:2]) for r in rows] == [(False, None)], pairs
        assert writer.execute(received).fetchall() == before, pairs
    args = _fresh_args([100], [(100, 5)])
    rows = writer.execute(PIPELINE.fresh, args).fetchall()
    assert [(r[0], r[2]) for r in rows] == [(True, 100)]  # ok, then the step row
    assert writer.execute(received).fetchall() == [(100, 1), (101, 0)]


def _plain_args(steps: list[int], pairs: list[tuple[int, int]]) -> dict[str, Any]:
    """The plain fresh write's parameters: each pair of ``pairs`` committed with one
    fragment, its fragments, commits and partials rows; each step of ``steps`` gaining
    its pairs."""
    args = _fresh_args(steps, pairs)
    per_step = [sum(1 for p, _ in pairs if p == s) for s in steps]
    args |= {
        "received": per_step, "committed": per_step, "expected": per_step,
        "f_step": [s for s, _ in pairs], "f_rank": [r for _, r in pairs],
        "f_seq": [0] * len(pairs), "f_values_f64": [b"\x00" * 8] * len(pairs),
        "f_present": [None] * len(pairs), "f_tails": [None] * len(pairs),
        "f_seqs": [None] * len(pairs),
        "c_step": [s for s, _ in pairs], "c_rank": [r for _, r in pairs],
        "c_fragments": [1] * len(pairs),
        "p_step": [s for s, _ in pairs], "p_rank": [r for _, r in pairs],
        "p_fragments": [1] * len(pairs), "p_state": [b"\x01"] * len(pairs),
        "open": "open", "refused": REFUSED_FINALISED,
        "keys": sorted(pair_lock_key(1, s, r) for s, r in pairs),
    }  # fmt: skip
    return args


def test_the_plain_write_reads_no_table_in_its_generic_plan(writer: psycopg.Connection) -> None:
    """The plain fresh write looks nothing up: its rows' keys (and the steps' one, for
    the upsert) check what the fresh write looks up."""
    names = tuple(dict.fromkeys(re.findall(r"%\((\w+)\)b", PIPELINE.fresh_plain)))
    args = _plain_args([300, 301], [(300, 5), (300, 6), (301, 255)])
    plan, rows = _generic_plan(writer, PIPELINE.fresh_plain, names, tuple(args[n] for n in names))
    assert _scans(plan) == [], "\n".join(plan)
    assert sorted((r[0], r[2], r[5], r[6]) for r in rows) == [
        (True, 300, 2, 2),  # ok, step, committed_ranks, expected
        (True, 301, 1, 1),
    ]


def test_the_plain_write_fails_on_a_stored_pair_or_a_finalised_step_and_writes_nothing(
    writer: psycopg.Connection,
) -> None:
    """Steps 100 (open) and 101 (partial): a batch of plain pairs that touches the
    partial step fails with ``ST001``, one with a pair whose commit (or partial row) is
    stored breaks that key; each writes nothing. One of new pairs of the open step adds
    to its counters and writes its rows."""
    writer.execute(
        "INSERT INTO steps (run_id, step, status, revision, committed_ranks, expected, "
        "received, missing_ranks, first_seen_at, deadline) VALUES (1, 100, 'open', 0, 0, 0, "
        "0, %(n)s, 0, 60), (1, 101, 'partial', 1, 0, 0, 0, %(n)s, 0, 60)",
        {"n": RANKS},
    )
    writer.execute("INSERT INTO commits VALUES (1, 100, 6, 8)")
    writer.execute("INSERT INTO partials VALUES (1, 100, 7, 1, '\\x00'::bytea)")
    counts = (
        "SELECT (SELECT array_agg(received ORDER BY step) FROM steps WHERE step >= 100), "
        "(SELECT count(*) FROM fragments WHERE step >= 100), "
        "(SELECT count(*) FROM commits WHERE step >= 100), "
        "(SELECT count(*) FROM partials WHERE step >= 100)"
    )
    before = writer.execute(counts).fetchone()
    assert before == ([0, 0], 0, 1, 1)
    for steps, pairs, sqlstate in (
        ([100, 101], [(100, 5), (101, 5)], "ST001"),  # the partial step
        ([101], [(101, 5)], "ST001"),  # the partial step alone: no step row comes back
        ([100], [(100, 5), (100, 6)], "23505"),  # (100, 6) has its commit stored
        ([100], [(100, 7)], "23505"),  # (100, 7) has its partial row stored
    ):
        with pytest.raises(psycopg.Error) as failed, writer.transaction():
            writer.execute(PIPELINE.fresh_plain, _plain_args(steps, pairs))
        assert failed.value.sqlstate == sqlstate, (pairs, failed.value)
        if sqlstate == "ST001":
            assert failed.value.diag.message_primary == REFUSED_FINALISED
        assert writer.execute(counts).fetchone() == before, pairs
    rows = writer.execute(PIPELINE.fresh_plain, _plain_args([100], [(100, 5), (100, 8)])).fetchall()
    assert [(r[0], r[2], r[5]) for r in rows] == [(True, 100, 2)]  # ok, step, committed
    assert writer.execute(counts).fetchone() == ([2, 0], 2, 3, 3)


def test_the_plain_write_takes_its_pairs_locks_before_it_writes(
    writer: psycopg.Connection, postgres_url: str
) -> None:
    """A writer holding a pair's lock (the general path between its probe and its
    apply) keeps the plain write of that pair waiting; what it commits meanwhile, the
    plain write then finds by its key, and writes nothing."""
    writer.commit()
    args = _plain_args([100], [(100, 5)])
    failed: list[BaseException] = []

    def write() -> None:
        try:
            writer.execute(PIPELINE.fresh_plain, args)
        except psycopg.Error as exc:
            failed.append(exc)
        writer.rollback()

    dsn = postgres_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn) as other:
        other.execute("SELECT pg_advisory_xact_lock(%s)", (pair_lock_key(1, 100, 5),))
        plain = threading.Thread(target=write)
        plain.start()
        plain.join(0.5)
        assert plain.is_alive()  # waiting for the pair's lock
        other.execute("INSERT INTO commits VALUES (1, 100, 5, 1)")
        other.commit()
        plain.join(10)
    assert not plain.is_alive()
    assert [getattr(e, "sqlstate", None) for e in failed] == ["23505"]
    fragments = writer.execute("SELECT count(*) FROM fragments WHERE step = 100").fetchone()
    assert fragments == (0,)


def test_a_writer_prepares_the_pairs_read_and_the_writes_but_plans_the_steps_read_anew(
    postgres_url: str,
) -> None:
    """The steps read runs unprepared: its plan made once may read the run's steps
    through another of their indexes (on empty tables PostgreSQL takes the status index,
    whose range for a run holds every step), so it is planned for its arrays each time."""
    from tests.integration.conftest import _empty

    _empty(postgres_url)
    names = ["loss", "kl"]
    app = create_app(Settings(database_url=postgres_url), sweep=False)
    with TestClient(app) as client:
        spec = {"name": "prep", "world_size": 2, "metrics": dict.fromkeys(names, "sum")}
        assert client.post("/v1/runs", json=spec).status_code == 201
        for again in (False, True):  # sent again: duplicates, probed before they are written
            for step in range(8):  # one group at a time
                for rank in range(2):
                    values = {"loss": 1.0, "kl": 2.0}
                    body = {
                        "fragments": [{"step": step, "rank": rank, "seq": 0, "values": values}],
                        "commits": [{"step": step, "rank": rank, "fragments": 1}],
                    }
                    answer = client.post("/v1/runs/prep/fragments", json=body)
                    assert answer.status_code == 200, answer.text
                    assert answer.json()["duplicates"] == int(again)
        store = app.state.store
        held = list(store._held)  # the writers' own connections
        assert held
        prepared = set()
        for conn in held:
            driver = conn.connection.driver_connection
            texts = driver.execute("SELECT statement FROM pg_prepared_statements").fetchall()
            prepared.update(t for (t,) in texts)

    def text(sql: str) -> str:
        return pg_pipeline.query(sql).text.decode()

    # the bodies' pairs are plain: the one-statement write is the plain one, and sent
    # again, it fails on their keys and the batches are probed and applied
    for sql in (PIPELINE.fresh_plain, PIPELINE.lock_pairs, PIPELINE.pairs_of, PIPELINE.apply):
        assert text(sql) in prepared, sql
    assert not [t for t in prepared if "step = ANY(" in t], prepared  # the steps read
    # psycopg prepares nothing of its own there: its DEALLOCATE ALL after a rollback
    # would take the writer's statements with it (tests/integration/test_group_errors.py)
    ours = {text(s) for s in vars(PIPELINE).values() if isinstance(s, str)}
    assert prepared <= ours, prepared - ours


def test_other_connections_keep_the_planner_as_it_is(postgres_url: str) -> None:
    engine = sa.create_engine(postgres_url)
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW enable_seqscan").scalar() == "on"
            assert conn.exec_driver_sql("SHOW plan_cache_mode").scalar() == "auto"
    finally:
        engine.dispose()
