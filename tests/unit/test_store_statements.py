"""PostgreSQL's pipelined statement text, generated from the tables (no database)."""

from __future__ import annotations

import dataclasses

from steptally.service.store.sql_statement import PIPELINE, STATE_COLUMNS, pair_lock_key


def test_every_value_is_bound_never_spelled_in_the_text() -> None:
    # bound in binary (%(name)b), cast to its column's type
    for field in dataclasses.fields(PIPELINE):
        text = getattr(PIPELINE, field.name)
        assert "'" not in text, field.name  # no literal: 'open' is bound as %(open)s


def test_counters_are_added_to_in_step_order_creating_new_steps() -> None:
    assert PIPELINE.add_to_steps == (
        "INSERT INTO steps (run_id, step, status, revision, committed_ranks, expected, "
        "received, missing_ranks, first_seen_at, deadline, finalised_at, result) "
        "SELECT %(run_id)b::INTEGER, d.step, %(status)b::VARCHAR(16), %(revision)b::INTEGER, "
        "d.committed, d.expected, d.received, %(world_size)b::INTEGER - d.committed, "
        "%(first_seen_at)b::DOUBLE PRECISION, %(deadline)b::DOUBLE PRECISION, "
        "%(finalised_at)b::DOUBLE PRECISION, %(result)b::TEXT "
        "FROM unnest(%(step)b::BIGINT[], %(received)b::BIGINT[], %(committed)b::INTEGER[], "
        "%(expected)b::BIGINT[]) AS d(step, received, committed, expected) ORDER BY d.step "
        "ON CONFLICT (run_id, step) DO UPDATE SET "
        "committed_ranks = steps.committed_ranks + excluded.committed_ranks, "
        "expected = steps.expected + excluded.expected, "
        "received = steps.received + excluded.received, "
        "missing_ranks = steps.missing_ranks - excluded.committed_ranks "
        "RETURNING run_id, step, status, revision, committed_ranks, expected, received, "
        "missing_ranks, first_seen_at, deadline, finalised_at, result"
    )
    columns = STATE_COLUMNS
    assert columns == (
        "step", "status", "revision", "committed_ranks", "expected", "received",
        "missing_ranks", "first_seen_at", "deadline", "finalised_at", "result",
    )  # fmt: skip


def test_pair_lock_keys_are_signed_64_bit_and_the_same_in_every_process() -> None:
    assert pair_lock_key(1, 0, 0) == 0x9E3779B97F4A7C15 - (1 << 64)
    keys = {
        pair_lock_key(run, step, rank) for run in (1, 2) for step in range(64) for rank in range(64)
    }
    assert len(keys) == 2 * 64 * 64
    assert all(-(1 << 63) <= k < (1 << 63) for k in keys)
    assert (
        PIPELINE.lock_pairs
        == "SELECT pg_advisory_xact_lock(k) FROM unnest(%(keys)b::BIGINT[]) AS k"
    )


def test_fragments_are_inserted_from_one_array_per_column() -> None:
    # a batch's writes are one statement: new fragments, new commits and partial rows in
    # WITH clauses (new rows only: the batch holds its pairs, the probe read what is
    # stored), then the counters, whose step rows it returns
    assert PIPELINE.apply.startswith(
        "WITH f AS (INSERT INTO fragments (run_id, step, rank, seq, values_f64, present, "
        "tails, seqs) SELECT %(run_id)b::INTEGER, * FROM unnest(%(f_step)b::BIGINT[], "
        "%(f_rank)b::INTEGER[], %(f_seq)b::BIGINT[], %(f_values_f64)b::BYTEA[], "
        "%(f_present)b::BYTEA[], %(f_tails)b::BYTEA[], %(f_seqs)b::BYTEA[])), "
        "c AS (INSERT INTO commits (run_id, step, rank, fragments) SELECT %(run_id)b::INTEGER, "
        "* FROM unnest(%(c_step)b::BIGINT[], %(c_rank)b::INTEGER[], %(c_fragments)b::BIGINT[])), "
        "p AS (INSERT INTO partials (run_id, step, rank, fragments, state) SELECT "
        "%(run_id)b::INTEGER, * FROM unnest(%(p_step)b::BIGINT[], %(p_rank)b::INTEGER[], "
        "%(p_fragments)b::BIGINT[], %(p_state)b::BYTEA[]) ON CONFLICT (run_id, step, rank) "
        "DO UPDATE SET fragments = excluded.fragments, state = excluded.state) "
    )
    assert PIPELINE.apply.endswith(PIPELINE.add_to_steps)
    assert PIPELINE.upsert_values == (
        "INSERT INTO step_values (run_id, col, step, value, state) "
        "SELECT %(run_id)b::INTEGER, * FROM unnest(%(col)b::INTEGER[], %(step)b::BIGINT[], "
        "%(value)b::DOUBLE PRECISION[], %(state)b::SMALLINT[]) "
        "ON CONFLICT (run_id, col, step) DO UPDATE SET value = excluded.value, "
        "state = excluded.state"
    )
