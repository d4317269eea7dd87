"""Errors of the algebra.

AlgebraError
├── SpecError          a run spec is invalid (bad name, unknown kind, bad expression)
│   ├── ExpressionError    a derived expression does not parse or names an unknown metric
│   └── AlertRuleError     an alert rule is malformed or checks an unknown metric
├── SpecConflict       a new spec contradicts the registered one (kind or meaning changed)
└── ValueRejected      a fragment value is not acceptable for its metric's kind
"""

from __future__ import annotations


class AlgebraError(ValueError):
    """Base of every error raised by :mod:`steptally.client.algebra`."""


class SpecError(AlgebraError):
    """A run spec is invalid."""


class ExpressionError(SpecError):
    """A derived expression does not parse, or refers to something unknown."""


class AlertRuleError(SpecError):
    """An alert rule of a spec is malformed, or checks a metric the spec lacks."""


class SpecConflict(AlgebraError):
    """A new spec contradicts the registered one."""

    def __init__(self, conflicts: list[str]) -> None:
        self.conflicts = conflicts
        super().__init__("; ".join(conflicts))


class ValueRejected(AlgebraError):
    """A value is not acceptable for its metric's kind."""
