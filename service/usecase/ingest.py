"""Ingest a batch of fragments and commits: decode, validate, store, count.

The body arrives as bytes (already decompressed and size-checked by the HTTP
layer); the answer is returned only after the store's transaction committed.

Strict (the default), a body is all-or-nothing: one wrong item rejects it with that
item's 4xx error. ``partial``, every wrong fragment or commit is left out and listed
in the answer's ``rejected`` (its ``where``, step, rank, seq, error code and message),
and the rest is stored, all or nothing, in one transaction. An item the store
refuses (a conflict with what is stored, a complete step) rolls that transaction
back; the item is left out and the rest is stored again, so a body with k refused
items costs k + 1 transactions. An error of the whole body (bad JSON, unknown run
or metric, too large) still rejects it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import orjson

from steptally.client.wire import FragmentBatch, WireError, decode_batch
from steptally.service.domain import compact
from steptally.service.domain.batch import PreparedBatch, Rejection, plain_of, prepare
from steptally.service.domain.partial import states_of
from steptally.service.domain.run import RunRecord
from steptally.service.errors import (
    BadJson,
    Conflict,
    InvalidPayload,
    ServiceError,
    UnknownMetric,
)
from steptally.service.metrics.instruments import Telemetry
from steptally.service.store.protocol import Answer, FinalisedStep, IngestOutcome, Store
from steptally.service.usecase.registration import RunDirectory


@dataclass(frozen=True, slots=True)
class Prepared:
    """A body decoded and checked for its run, ready for the store; ``fragments`` is how
    many it carried."""

    run: RunRecord
    batch: PreparedBatch
    fragments: int
    partial: bool


class Ingest:
    """``POST /v1/runs/{run}/fragments`` without the HTTP: called whole, or in three
    parts — :meth:`prepare`, :meth:`submit`, :meth:`answered` — so that the HTTP layer
    waits for the store's commit without holding a thread."""

    def __init__(
        self,
        store: Store,
        runs: RunDirectory,
        telemetry: Telemetry,
        clock: Callable[[], float],
        published: Callable[[list[FinalisedStep]], None] = lambda _: None,
    ) -> None:
        self._store = store
        self._runs = runs
        self._telemetry = telemetry
        self._clock = clock
        self._published = published  # told of the steps a committed batch finalised

    def __call__(
        self, run_name: str, body: bytes, arrived: float | None = None, partial: bool = False
    ) -> dict[str, Any]:
        """Store the batch in ``body``; ``arrived`` is the request's ``perf_counter``."""
        arrived = time.perf_counter() if arrived is None else arrived
        prepared = self.prepare(run_name, body, partial)
        try:
            if partial:
                outcome = self._store_partial(prepared.run, prepared.batch)
            else:
                outcome = self._store.ingest(prepared.run, prepared.batch, self._clock())
        except ServiceError as exc:
            self.refused(prepared, exc)
            raise
        return self.answered(prepared, outcome, arrived)

    def prepare(self, run_name: str, body: bytes, partial: bool = False) -> Prepared:
        """Decode, check and pack the batch in ``body`` for its run (a 4xx error if it is
        wrong), with its pairs' exact partial states: everything before the store."""
        run = self._runs.get(run_name)
        parsed = parse(body)
        fast = compact.prepared(run, parsed[0]) if parsed[1] else None
        if fast is not None:  # the reporter's body, right as it came
            return Prepared(run, fast, len(fast.fragments), partial)
        decoded, columnar = decode(parsed)
        try:
            run, batch = _prepare(self._runs, run, decoded, columnar, partial)
        except ServiceError as exc:
            self._telemetry.fragments_refused(run.name, exc.code, len(decoded.steps))
            raise
        return Prepared(run, batch, len(decoded.steps), partial)

    def submit(self, prepared: Prepared) -> Future[IngestOutcome]:
        """Store a prepared batch (not ``partial``) without waiting: its outcome once its
        group committed, to hand to :meth:`answered` (an error: to :meth:`refused`)."""
        return self._store.submit(prepared.run, prepared.batch, self._clock())

    def submit_call(
        self, prepared: Prepared, loop: asyncio.AbstractEventLoop, answer: Answer
    ) -> None:
        """:meth:`submit` answered on ``loop``: ``answer`` is called there with the outcome
        or the error (the batches of one group in one call on the loop)."""
        self._store.submit_call(prepared.run, prepared.batch, self._clock(), loop, answer)

    def refused(self, prepared: Prepared, error: ServiceError) -> None:
        """Count a batch the store refused whole."""
        self._telemetry.fragments_refused(prepared.run.name, error.code, prepared.fragments)

    def answered(
        self, prepared: Prepared, outcome: IngestOutcome, arrived: float
    ) -> dict[str, Any]:
        """Count a stored batch, publish the steps it finalised; its answer."""
        run, batch = prepared.run, prepared.batch
        for r in batch.rejected:
            if r.seq is not None:
                self._telemetry.fragments_refused(run.name, r.code)
        self._telemetry.batch_stored(run.name, outcome, time.perf_counter() - arrived)
        if outcome.finalised:
            self._published(outcome.finalised)
        out = answer(outcome)
        if prepared.partial:
            out["rejected"] = [rejection_json(r) for r in batch.rejected]
        return out

    def _store_partial(self, run: RunRecord, batch: PreparedBatch) -> IngestOutcome:
        """Store what the store accepts; each refused item is left out, then again."""
        while batch:
            try:
                return self._store.ingest(run, batch, self._clock())
            except Conflict as exc:
                if not batch.reject(exc):
                    raise
        return IngestOutcome(accepted=0, duplicates=0, commits=0)


def parse(body: bytes) -> tuple[Any, bool]:
    """The decoded JSON and whether it is in the compact (columnar) form."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadJson(f"the body is not valid JSON: {exc}") from None
    return data, isinstance(data, dict) and data.get("columnar") is not None


def decode(parsed: tuple[Any, bool]) -> tuple[FragmentBatch, bool]:
    """The body's fragments and commits, and whether it came in the compact form."""
    data, columnar = parsed
    try:
        return decode_batch(data), columnar
    except WireError as exc:
        raise InvalidPayload(exc.message, exc.where or None) from None


def _prepare(
    runs: RunDirectory, run: RunRecord, batch: FragmentBatch, columnar: bool, partial: bool
) -> tuple[RunRecord, PreparedBatch]:
    """The batch checked and packed for the run (read again if the batch names a
    metric registered since), with its pairs' exact partial states (computed here,
    before the store's transaction, rather than inside it)."""
    try:
        prepared = prepare(run, batch, columnar, partial)
    except UnknownMetric:  # perhaps registered since the run was cached
        run = runs.get(run.name, refresh=True)
        prepared = prepare(run, batch, columnar, partial)
    prepared.states = states_of(run, prepared.fragments)
    prepared.set_plain(plain_of(prepared.fragments, prepared.commits))
    return run, prepared


def answer(outcome: IngestOutcome) -> dict[str, Any]:
    return {
        "accepted": outcome.accepted,
        "duplicates": outcome.duplicates,
        "commits": outcome.commits,
        "finalised": [
            {"step": f.step, "status": f.status.value, "revision": f.revision}
            for f in outcome.finalised
        ],
    }


def rejection_json(r: Rejection) -> dict[str, Any]:
    return {
        "where": r.where,
        "step": r.step,
        "rank": r.rank,
        "seq": r.seq,
        "code": r.code,
        "message": r.message,
    }
