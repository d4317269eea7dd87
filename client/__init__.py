"""Steptally's worker side: the exact fragment algebra, the wire format, the reporter
and (with the ``torch`` extra) the clipped policy-gradient loss that emits fragments."""

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
    "SpecConflict",
    "SpecError",
    "StepAccumulator",
    "ValueRejected",
    "combine",
]
