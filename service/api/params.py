"""Path and query parameters, validated before a route runs (422 ``invalid_payload``
with ``where`` such as ``path.run`` or ``query.start``), and documented in OpenAPI.

A run name in a path must match the contract's pattern in full (no trailing newline,
NUL, leading space or non-ASCII: nothing the database could choke on); steps and
step bounds are integers from 0 to 2**63 - 1.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query

from steptally.service.domain.limits import MAX_INT

RUN_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"

RunName = Annotated[str, Path(pattern=RUN_PATTERN, max_length=128)]
StepNumber = Annotated[int, Path(ge=0, le=MAX_INT)]
StepBound = Annotated[int | None, Query(ge=0, le=MAX_INT)]
