"""Finalisation through the stored partials gives the bits the fragments give.

Every step below is finalised by the store from its ``partials`` rows (each rank's
fragments arrive over several batches, so rows are merged, not only inserted) and
compared, metric by metric and every field of each, with a single pass of the
client's algebra over the same fragments as sent: exact sums with tails, NaN and
both infinities, -0.0, absent metrics, a guarded minimum, counts, a derived ratio.
A step timed out as partial and revised by a late rank is compared at each revision;
a step whose partial rows were removed is finalised from its fragments, alike.
"""

from __future__ import annotations

import math
import random
from typing import Any

import sqlalchemy as sa

from steptally.client.algebra import MetricSpec, combine
from steptally.client.algebra.exact import expansion_of
from steptally.client.wire import decode_batch
from steptally.service.domain.batch import prepare
from steptally.service.domain.finalise import metric_json
from steptally.service.domain.run import RunDraft, RunRecord
from steptally.service.settings import Settings
from steptally.service.store.protocol import Store

SPEC = MetricSpec.build(
    {"a": "sum", "b": "sum", "n": "count", "lo": "min", "hi": "max"},
    {"mean": "a / n", "spread": "(hi - lo) / (b + 1)"},
    {"lo": "n"},
)
T0 = 1_000.0
TIMEOUT_S = 60.0
WIRE = {math.inf: "Infinity", -math.inf: "-Infinity"}


def _wire(v: Any) -> Any:
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    return WIRE.get(v, v)


class Sender:
    """Sends fragments of run ``r`` and keeps them as sent, for the reference."""

    def __init__(self, store: Store, world_size: int) -> None:
        self.store = store
        self.run, _ = store.register_run("r", lambda _: RunDraft(world_size, SPEC, TIMEOUT_S), T0)
        self.sent: dict[int, list[dict[str, Any]]] = {}

    def send(self, frags: list[tuple[int, int, int, dict[str, Any]]], commits: list[Any]) -> Any:
        body = {
            "fragments": [
                {"step": s, "rank": r, "seq": q, "values": {k: _wire(v) for k, v in vals.items()}}
                for s, r, q, vals in frags
            ],
            "commits": [{"step": s, "rank": r, "fragments": n} for s, r, n in commits],
        }
        outcome = self.store.ingest(self.run, prepare(self.run, decode_batch(body), False), T0 + 1)
        for s, _, _, vals in frags:
            self.sent.setdefault(s, []).append(vals)
        return outcome

    def check(self, step: int, status: str, revision: int) -> None:
        got = self.store.get_step(self.run, step)
        assert got is not None and got.result is not None
        assert (got.status.value, got.revision) == (status, revision)
        reference = {n: metric_json(r) for n, r in combine(SPEC, self.sent[step]).items()}
        assert dict(got.result.metrics) == reference


def _values(rnd: random.Random, rank: int, seq: int) -> dict[str, Any]:
    pick = rnd.random()
    values: dict[str, Any] = {
        "a": expansion_of([rnd.uniform(-1, 1) * 2.0 ** rnd.randint(-60, 60) for _ in range(3)]),
        "b": rnd.choice([0.1 * seq - 0.3, -0.0, 1e308, -1e308, 3.0**-rank]),
        "n": float(rnd.randrange(0, 5)),
        "lo": rnd.choice([-0.0, 0.0, rnd.gauss(0, 1), -math.inf]),
        "hi": rnd.gauss(0, 10),
    }
    if pick < 0.1:
        values["b"] = math.nan
    elif pick < 0.2:
        values["a"] = rnd.choice([math.inf, -math.inf])
    elif pick < 0.3:
        values["hi"] = math.nan
    for name in ("b", "lo", "hi", "n"):  # absent metrics
        if rnd.random() < 0.15:
            del values[name]
    return values


def _partial_rows(settings: Settings, run: RunRecord, step: int) -> list[tuple[int, int]]:
    engine = sa.create_engine(settings.database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT rank, fragments FROM partials WHERE run_id = :r AND step = :s"),
                {"r": run.id, "s": step},
            )
            return sorted((int(r), int(n)) for r, n in rows)
    finally:
        engine.dispose()


def _drop_partials(settings: Settings, run: RunRecord, step: int) -> None:
    engine = sa.create_engine(settings.database_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text("DELETE FROM partials WHERE run_id = :r AND step = :s"),
                {"r": run.id, "s": step},
            )
    finally:
        engine.dispose()


def test_partials_finalise_to_the_bits_of_the_fragments(store: Store, settings: Settings) -> None:
    rnd = random.Random(11)
    ranks, per_rank = 5, 6
    sender = Sender(store, ranks)
    for step in range(4):
        if step == 3:  # from the fragments: its partial rows are removed before it completes
            for rank in range(ranks - 1):
                frags = [(step, rank, q, _values(rnd, rank, q)) for q in range(per_rank)]
                sender.send(frags, [(step, rank, per_rank)])
            _drop_partials(settings, sender.run, step)
        for rank in range(0 if step < 3 else ranks - 1, ranks):
            for part in range(3):  # each rank in three batches, the commit with the last
                frags = [
                    (step, rank, q, _values(rnd, rank, q)) for q in range(part * 2, part * 2 + 2)
                ]
                sender.send(frags, [(step, rank, per_rank)] if part == 2 else [])
        sender.check(step, "complete", 1)
        if step < 3:
            rows = _partial_rows(settings, sender.run, step)
            assert rows == [(r, per_rank) for r in range(ranks)]
    assert sender.sent[1] != sender.sent[2]


def test_a_late_rank_revises_a_partial_step_from_its_partials(
    store: Store, settings: Settings
) -> None:
    rnd = random.Random(5)
    sender = Sender(store, 3)
    for rank in range(2):
        sender.send([(0, rank, q, _values(rnd, rank, q)) for q in range(4)], [(0, rank, 4)])
    assert [f.status.value for f in store.sweep(T0 + 1 + TIMEOUT_S)] == ["partial"]
    sender.check(0, "partial", 1)
    late = sender.send([(0, 2, q, _values(rnd, 2, q)) for q in range(2)], [])
    assert [(f.status.value, f.revision) for f in late.finalised] == [("partial", 2)]
    sender.check(0, "partial", 2)
    done = sender.send([(0, 2, q, _values(rnd, 2, q)) for q in range(2, 3)], [(0, 2, 3)])
    assert [(f.status.value, f.revision) for f in done.finalised] == [("complete", 3)]
    sender.check(0, "complete", 3)
    assert _partial_rows(settings, sender.run, 0) == [(0, 4), (1, 4), (2, 3)]
