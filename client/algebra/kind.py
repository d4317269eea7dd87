"""Metric kinds and the names they may carry."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from enum import StrEnum

from steptally.client.algebra.errors import SpecError, ValueRejected
from steptally.client.algebra.exact import MAX_TERMS

NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}", re.ASCII)


class Kind(StrEnum):
    """How fragments of a metric combine over a step."""

    SUM = "sum"
    COUNT = "count"
    MIN = "min"
    MAX = "max"


def check_name(name: object) -> str:
    """Return ``name`` if it is a valid metric name, else raise :class:`SpecError`."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise SpecError(
            f"metric name {name!r:.40} is invalid: use letters, digits and '_', "
            "starting with a letter or '_', at most 128 characters"
        )
    return name


def parse_kind(value: object, name: str) -> Kind:
    """Return the :class:`Kind` spelled by ``value`` for metric ``name``."""
    try:
        if not isinstance(value, str):
            raise ValueError
        return Kind(value)
    except ValueError:
        allowed = ", ".join(k.value for k in Kind)
        raise SpecError(f"metric {name!r} has kind {value!r}; use one of {allowed}") from None


def check_value(kind: Kind, value: float, name: str) -> float:
    """Validate one fragment value of ``kind``; non-finite values are data for all but counts."""
    if kind is Kind.COUNT and not (math.isfinite(value) and value >= 0 and value == int(value)):
        raise ValueRejected(
            f"metric {name!r} is a count, so its value must be a non-negative integer, "
            f"not {value!r}"
        )
    return value


def check_expansion(terms: Sequence[float], name: str, limit: int = MAX_TERMS) -> None:
    """Validate the terms of a sum's exact expansion: 1 to ``limit`` numbers, all
    finite when there is more than one (a non-finite value is one plain number)."""
    if not 1 <= len(terms) <= limit:
        raise ValueRejected(
            f"metric {name!r}: an expansion holds 1 to {limit} numbers, not {len(terms)}"
        )
    if len(terms) > 1 and not all(map(math.isfinite, terms)):
        raise ValueRejected(
            f"metric {name!r}: the terms of an expansion must be finite; send a "
            "non-finite value as one number"
        )
