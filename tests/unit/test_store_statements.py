"""PostgreSQL's pipelined statement text, generated from the tables (no database)."""

from __future__ import annotations

import dataclasses

from steptally.service.store.sql_statement import PIPELINE, STATE_COLUMNS, STEP_FIELDS


def test_every_value_is_bound_never_spelled_in_the_text() -> None:
    for field in dataclasses.fields(PIPELINE):
        text = getattr(PIPELINE, field.name)
        assert "'" not in text, field.name  # no literal: 'open' is bound as %(open)s


def test_a_new_steps_row_binds_each_column_cast_to_its_type() -> None:
    assert PIPELINE.lock_steps == (
        "INSERT INTO steps (run_id, step, status, revision, committed_ranks, expected, "
        "received, missing_ranks, first_seen_at, deadline, finalised_at, result) "
        "SELECT %(run_id)s::INTEGER, s, %(status)s::VARCHAR(16), %(revision)s::INTEGER, "
        "%(committed_ranks)s::INTEGER, %(expected)s::BIGINT, %(received)s::BIGINT, "
        "%(missing_ranks)s::INTEGER, %(first_seen_at)s::DOUBLE PRECISION, "
        "%(deadline)s::DOUBLE PRECISION, %(finalised_at)s::DOUBLE PRECISION, "
        "%(result)s::TEXT FROM unnest(%(steps)s::BIGINT[]) AS s "
        "ON CONFLICT (run_id, step) DO UPDATE SET status = steps.status "
        "RETURNING run_id, step, status, revision, committed_ranks, expected, received, "
        "missing_ranks, first_seen_at, deadline, finalised_at, result"
    )
    columns = STATE_COLUMNS
    assert columns == (
        "step", "status", "revision", "committed_ranks", "expected", "received",
        "missing_ranks", "first_seen_at", "deadline", "finalised_at", "result",
    )  # fmt: skip


def test_fragments_are_inserted_from_one_array_per_column() -> None:
    assert PIPELINE.insert_fragments == (
        "INSERT INTO fragments (run_id, step, rank, seq, values_f64, present, tails) "
        "SELECT %(run_id)s::INTEGER, * FROM unnest(%(step)s::BIGINT[], %(rank)s::INTEGER[], "
        "%(seq)s::BIGINT[], %(values_f64)s::BYTEA[], %(present)s::BYTEA[], "
        "%(tails)s::BYTEA[]) ON CONFLICT DO NOTHING RETURNING step, rank, seq"
    )
    assert PIPELINE.upsert_values == (
        "INSERT INTO step_values (run_id, col, step, value, state) "
        "SELECT %(run_id)s::INTEGER, * FROM unnest(%(col)s::INTEGER[], %(step)s::BIGINT[], "
        "%(value)s::DOUBLE PRECISION[], %(state)s::SMALLINT[]) "
        "ON CONFLICT (run_id, col, step) DO UPDATE SET value = excluded.value, "
        "state = excluded.state"
    )


def test_the_step_update_sets_exactly_the_fields_a_batch_changes() -> None:
    assert PIPELINE.update_steps.startswith("UPDATE steps SET status = %(status)s::VARCHAR(16), ")
    assert PIPELINE.update_steps.endswith(" WHERE run_id = %(run)s AND step = %(step)s")
    assert PIPELINE.update_steps.count(" = %(") == len(STEP_FIELDS) + 2
