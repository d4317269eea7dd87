"""What a run's registration may ask for (pure): every limit is checked before the
work it bounds, each with its own setting (``docs/security.md``, Limits).

Also :func:`brief`, how an error message shows a piece of the offending input: never
the whole of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from steptally.client.algebra.spec import SpecLimits
from steptally.service.errors import InvalidSpec

MAX_INT = 2**63 - 1  # steps, seqs, ranks and counts are below 2**63 (a BIGINT)
MAX_SHOWN = 40  # characters of an input an error message quotes


def brief(value: object) -> str:
    """``repr(value)``, cut to about ``MAX_SHOWN`` characters."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else f"{text[: MAX_SHOWN - 1]}…"


@dataclass(frozen=True)
class RunLimits:
    max_world_size: int = 1_048_576
    max_step_timeout_s: float = 7 * 86_400.0
    spec: SpecLimits = field(default_factory=SpecLimits)

    def check(self, world_size: int, step_timeout_s: float | None) -> None:
        """Raise :class:`InvalidSpec` for a world size or step timeout out of range."""
        if not 1 <= world_size <= self.max_world_size:
            raise InvalidSpec(
                f"world_size must be from 1 to {self.max_world_size} (STEPTALLY_MAX_WORLD_SIZE)",
                "world_size",
            )
        if step_timeout_s is not None and not (
            math.isfinite(step_timeout_s) and 0 < step_timeout_s <= self.max_step_timeout_s
        ):
            raise InvalidSpec(
                "step_timeout_s must be a number of seconds above 0 and at most "
                f"{self.max_step_timeout_s:g} (STEPTALLY_MAX_STEP_TIMEOUT_S)",
                "step_timeout_s",
            )
