"""A metric's JSON value read through one table: as stored (value, state) and as
``/metrics`` shows it."""

from __future__ import annotations

import math
from typing import Any

import pytest

from steptally.service.domain.finalise import ValueState, read_value, shown_value


@pytest.mark.parametrize(
    ("value", "stored", "shown"),
    [
        (None, (None, ValueState.UNDEFINED), None),
        ("NaN", (None, ValueState.NAN), "nan"),
        ("Infinity", (math.inf, ValueState.NUMBER), math.inf),
        ("-Infinity", (-math.inf, ValueState.NUMBER), -math.inf),
        (2.5, (2.5, ValueState.NUMBER), 2.5),
        (0.0, (0.0, ValueState.NUMBER), 0.0),
        (-3, (-3.0, ValueState.NUMBER), -3.0),
    ],
)
def test_value_read(value: float | str | None, stored: tuple[Any, ValueState], shown: Any) -> None:
    assert read_value(value) == stored
    got = shown_value(value)
    if shown == "nan":
        assert got is not None and math.isnan(got)
    else:
        assert got == shown
        assert type(got) is type(shown)
