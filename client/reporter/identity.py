"""Which rank this process is, and how many ranks the run has.

Sources, in order of authority: an initialised ``torch.distributed`` (looked at only
when torch is already imported, so that the reporter never imports torch), the
``RANK`` / ``WORLD_SIZE`` environment variables (as set by torchrun), and the
arguments. Every source that gives a value must agree with the others; a value no
source gives, or an out-of-range rank, is an :class:`IdentityError`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from steptally.client.reporter.errors import IdentityError


@dataclass(frozen=True, slots=True)
class Identity:
    rank: int
    world_size: int


def _from_torch() -> tuple[int | None, int | None]:
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None, None
    return int(dist.get_rank()), int(dist.get_world_size())


def _from_env(env: Mapping[str, str], key: str) -> int | None:
    text = env.get(key)
    if text is None or text.strip() == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise IdentityError(f"the environment variable {key}={text!r} is not an integer") from None


def _agree(what: str, sources: list[tuple[str, int | None]]) -> int | None:
    given = [(name, value) for name, value in sources if value is not None]
    for name, value in given[1:]:
        first_name, first = given[0]
        if value != first:
            raise IdentityError(
                f"the {what} is {first} according to {first_name} but {value} according to "
                f"{name}; remove the contradicting one"
            )
    return given[0][1] if given else None


def resolve_identity(
    rank: int | None = None,
    world_size: int | None = None,
    env: Mapping[str, str] | None = None,
) -> Identity:
    """The rank and world size of this process, from torch.distributed, env or arguments."""
    env = os.environ if env is None else env
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise IdentityError(f"{name} must be an integer, not {value!r}")
    torch_rank, torch_world = _from_torch()
    r = _agree(
        "rank",
        [("torch.distributed", torch_rank), ("RANK", _from_env(env, "RANK")), ("rank=", rank)],
    )
    w = _agree(
        "world size",
        [
            ("torch.distributed", torch_world),
            ("WORLD_SIZE", _from_env(env, "WORLD_SIZE")),
            ("world_size=", world_size),
        ],
    )
    if r is None or w is None:
        missing = " and ".join(n for n, v in (("rank", r), ("world size", w)) if v is None)
        raise IdentityError(
            f"the {missing} is unknown: initialise torch.distributed, run under torchrun "
            "(RANK, WORLD_SIZE), or pass rank= and world_size= to the Reporter"
        )
    if w < 1:
        raise IdentityError(f"the world size must be at least 1, not {w}")
    if not 0 <= r < w:
        raise IdentityError(f"rank {r} is out of range for a world size of {w} (0 to {w - 1})")
    return Identity(r, w)
