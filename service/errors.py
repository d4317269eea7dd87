"""Errors of the service, each with an HTTP status and a machine-readable code.

    ServiceError                   500 internal
    ├── BadRequest                 400
    │   ├── BadJson                    bad_json
    │   └── UnsupportedEncoding        unsupported_encoding
    ├── Unauthenticated            401 unauthenticated (no token, or not a valid one)
    ├── Forbidden                  403 forbidden (the token's scope or run does not allow it)
    ├── NotFound                   404
    │   ├── UnknownRun                 unknown_run
    │   └── UnknownStep                unknown_step
    ├── Conflict                   409
    │   ├── SpecConflictError          spec_conflict
    │   ├── FragmentConflict           fragment_conflict
    │   ├── CommitConflict             commit_conflict
    │   └── StepComplete               step_complete
    ├── TooLarge                   413 too_large
    ├── UnsupportedMediaType       415 unsupported_media_type (a JSON route, another type)
    ├── Invalid                    422
    │   ├── InvalidPayload             invalid_payload
    │   ├── InvalidSpec                invalid_spec
    │   ├── UnknownMetric              unknown_metric
    │   ├── InvalidValue               invalid_value
    │   └── RankOutOfRange             rank_out_of_range
    ├── RateLimited                429 rate_limited
    ├── NotMigrated                503 not_migrated (the database schema is not at head)
    └── Unavailable                503 unavailable (the database did not answer in time)

Every 503 and 429 answer carries ``Retry-After``; every 401 ``WWW-Authenticate: Bearer``.

``message`` is a sentence a person can act on; ``where`` locates the offending item
(``fragments[3].values.loss``) or is None. ``service/api/errors.py`` is the one place
that turns them into responses.
"""

from __future__ import annotations


class ServiceError(Exception):
    status = 500
    code = "internal"

    def __init__(self, message: str, where: str | None = None) -> None:
        self.message = message
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


class BadRequest(ServiceError):
    status = 400
    code = "bad_request"


class BadJson(BadRequest):
    code = "bad_json"


class UnsupportedEncoding(BadRequest):
    code = "unsupported_encoding"


class Unauthenticated(ServiceError):
    status = 401
    code = "unauthenticated"

    def __init__(self, message: str, invalid: bool = False) -> None:
        super().__init__(message)
        # RFC 6750: a token was sent but is not valid
        self.challenge = 'Bearer realm="steptally"' + (', error="invalid_token"' if invalid else "")


class Forbidden(ServiceError):
    status = 403
    code = "forbidden"


class NotFound(ServiceError):
    status = 404
    code = "not_found"


class MetricNotFound(NotFound):
    """A read (a series, the steps list's ``metric=``) of a metric the run does not
    have: the view asked for is not there (in a body, ``unknown_metric``, a 422)."""

    code = "metric_not_found"


class RuleNotFound(NotFound):
    """A read of breaches (``rule=``) of an alert rule the run does not have."""

    code = "rule_not_found"


class UnknownRun(NotFound):
    code = "unknown_run"


class UnknownStep(NotFound):
    code = "unknown_step"


class Conflict(ServiceError):
    status = 409
    code = "conflict"


class SpecConflictError(Conflict):
    code = "spec_conflict"


class FragmentConflict(Conflict):
    code = "fragment_conflict"


class CommitConflict(Conflict):
    code = "commit_conflict"


class StepComplete(Conflict):
    code = "step_complete"


class TooLarge(ServiceError):
    status = 413
    code = "too_large"


class UnsupportedMediaType(ServiceError):
    status = 415
    code = "unsupported_media_type"


class Invalid(ServiceError):
    status = 422
    code = "invalid"


class InvalidPayload(Invalid):
    code = "invalid_payload"


class InvalidSpec(Invalid):
    code = "invalid_spec"


class UnknownMetric(Invalid):
    code = "unknown_metric"


class InvalidValue(Invalid):
    code = "invalid_value"


class RankOutOfRange(Invalid):
    code = "rank_out_of_range"


class RateLimited(ServiceError):
    status = 429
    code = "rate_limited"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotMigrated(ServiceError):
    status = 503
    code = "not_migrated"


class Unavailable(ServiceError):
    status = 503
    code = "unavailable"
