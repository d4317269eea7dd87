"""The exact fragment algebra, shared by the workers and the service (stdlib only)."""

from steptally.client.algebra.combine import MetricResult, StepAccumulator, combine
from steptally.client.algebra.errors import (
    AlgebraError,
    ExpressionError,
    SpecConflict,
    SpecError,
    ValueRejected,
)
from steptally.client.algebra.kind import Kind
from steptally.client.algebra.spec import MetricSpec

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
