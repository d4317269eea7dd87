"""The JSON answers of the REST API as pydantic models: what ``/openapi.json`` documents.

The routes build their answers as plain dicts and send them with orjson
(:class:`JsonResponse`, non-finite numbers already strings), so FastAPI documents these
models but does not re-validate every answer on the way out (the ingest path stays
as fast as before, and a series of 100,000 values is not walked twice); the tests
validate real answers against them. A number that is not finite travels as the
string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``, hence ``float | str``.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

Number = float | Literal["NaN", "Infinity", "-Infinity"]
Status = Literal["open", "complete", "partial"]
FinalStatus = Literal["complete", "partial"]
ResponseDocs = dict[int | str, dict[str, Any]]


def json_bytes(content: Any) -> bytes:
    """The service's JSON encoding of an answer."""
    return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)


class JsonResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json_bytes(content)


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Answer):
    code: str = Field(description="machine-readable, e.g. unknown_run")
    message: str = Field(description="a sentence a person can act on")
    where: str | None = Field(description="the offending item, e.g. fragments[3].values.loss")


class ErrorAnswer(_Answer):
    """Every non-2xx answer."""

    error: ErrorDetail


class StepCounts(_Answer):
    open: int
    complete: int
    partial: int


class AlertRuleAnswer(_Answer):
    """One condition per rule: above and/or below, change_above, missing_ranks_above or
    non_finite."""

    name: str
    metric: str | None = Field(default=None, description="absent for missing_ranks_above")
    above: float | None = None
    below: float | None = None
    change_above: float | None = Field(
        default=None, description="breach when |value - mean of the window| is more"
    )
    window: int | None = Field(default=None, description="earlier steps a change compares with")
    relative: bool | None = Field(default=None, description="change_above times |mean|")
    missing_ranks_above: int | None = None
    non_finite: bool | None = None


class RunAnswer(_Answer):
    name: str
    world_size: int
    metrics: dict[str, Literal["sum", "count", "min", "max"]]
    derived: dict[str, str]
    guards: dict[str, str]
    alerts: list[AlertRuleAnswer] = Field(description="checked at every finalisation")
    step_timeout_s: float
    created_at: str | None
    last_finalised_step: int | None
    last_finalised_at: str | None = Field(description="when the latest finalisation happened")
    steps: StepCounts
    breaches: dict[str, int] = Field(description="steps that broke each alert rule")


class RunPage(_Answer):
    runs: list[RunAnswer]
    next_cursor: str | None = Field(description="pass as cursor for the next page; null: done")


class MetricValue(_Answer):
    value: Number | None = Field(description="null when undefined; see reason")
    reason: str | None
    kind: str | None
    values: int = Field(description="how many values contributed")
    non_finite: int


class BreachAnswer(_Answer):
    rule: str
    condition: Literal["above", "below", "change_above", "missing_ranks_above", "non_finite"]
    metric: str | None = Field(description="null for missing_ranks_above")
    value: Number = Field(description="the value checked (the missing-rank count)")
    threshold: Number | None = Field(default=None, description="the rule's bound")
    mean: Number | None = Field(default=None, description="the window's mean (change_above)")


class BreachRecordAnswer(BreachAnswer):
    step: int
    revision: int = Field(description="the revision that first broke the rule")
    finalised_at: str | None


class BreachPage(_Answer):
    breaches: list[BreachRecordAnswer]
    next_cursor: str | None = Field(description="pass as cursor for the next page; null: done")


class SeriesBreach(_Answer):
    step: int
    rule: str


class FragmentCounts(_Answer):
    received: int
    expected: int | None


class StepAnswer(_Answer):
    run: str
    step: int
    status: Status
    revision: int = Field(description="0 while open, +1 at each finalisation")
    world_size: int
    ranks_committed: list[int]
    ranks_missing: list[int] = Field(description="the lowest missing ranks, at most 1000")
    ranks_missing_count: int = Field(description="how many ranks are missing in all")
    ranks_late: list[int] = Field(description="committed only after a partial finalisation")
    fragments: FragmentCounts
    missing_fragments: dict[str, int]
    metrics: dict[str, MetricValue]
    breaches: list[BreachAnswer] = Field(
        description="the run's alert rules this revision broke (empty while open)"
    )
    first_seen_at: str | None
    finalised_at: str | None


class StepPage(_Answer):
    steps: list[StepAnswer]
    next_cursor: str | None


class SeriesAnswer(_Answer):
    metric: str
    kind: Literal["sum", "count", "min", "max", "derived"]
    total: int = Field(description="finalised steps in the range")
    downsampled: bool
    steps: list[int]
    values: list[Number | None]
    status: list[FinalStatus]
    revision: list[int]
    breaches: list[SeriesBreach] = Field(
        description="steps of the range that broke a rule on this metric (every one, "
        "downsampled or not; the first 10,000)"
    )


class Finalised(_Answer):
    step: int
    status: FinalStatus
    revision: int


class RejectedItem(_Answer):
    """A fragment (``seq`` set) or commit (``seq`` null) left out of a partial ingest."""

    where: str = Field(description="the item in the body, e.g. columnar.step[3] or commits[0]")
    step: int
    rank: int
    seq: int | None
    code: str = Field(description="the error code a strict ingest would answer")
    message: str


class IngestAnswer(_Answer):
    accepted: int
    duplicates: int
    commits: int
    finalised: list[Finalised]
    rejected: list[RejectedItem] | None = Field(
        default=None, description="only with ?partial=true: the items left out, and why"
    )


class HealthAnswer(_Answer):
    status: Literal["ok", "ready"]


def errors(*statuses: int, also: ResponseDocs | None = None) -> ResponseDocs:
    """The ``responses=`` of a route: each status answered with :class:`ErrorAnswer`,
    and the answers ``also`` documents."""
    described = {
        400: "the body is not JSON, or its encoding is not supported",
        404: "no such run or step",
        409: "conflicts with what is stored",
        413: "the body is too large",
        415: "the body is not JSON (Content-Type)",
        422: "invalid parameters or payload",
        503: "the database does not answer, or the service is busy: retry after Retry-After",
    }
    out: ResponseDocs = {s: {"model": ErrorAnswer, "description": described[s]} for s in statuses}
    return {**out, **(also or {})}
