"""Steptally's worker side: the exact fragment algebra, the wire format, the reporter
and (with the ``torch`` extra) the clipped policy-gradient loss that emits fragments."""

from typing import TYPE_CHECKING, Any

from steptally.client.algebra import (
    AlgebraError,
    ExpressionError,
    Kind,
    MetricResult,
    MetricSpec,
    SpecConflict,
    SpecError,
    StepAccumulator,
    ValueRejected,
    combine,
)

__all__ = [
    "AlgebraError",
    "ExpressionError",
    "Kind",
    "MetricResult",
    "MetricSpec",
    "Reporter",
    "SpecConflict",
    "SpecError",
    "StepAccumulator",
    "ValueRejected",
    "combine",
]

if TYPE_CHECKING:
    from steptally.client.reporter import Reporter


def __getattr__(name: str) -> Any:
    # The reporter needs httpx (the ``client`` extra); import it only when asked for.
    if name == "Reporter":
        from steptally.client.reporter import Reporter

        return Reporter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
