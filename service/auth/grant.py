"""What a caller may register with ``POST /v1/runs``: the part of the policy that needs
the body and the stored run, checked inside the registration."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from steptally.service.errors import Forbidden


@dataclass(frozen=True)
class Grant:
    """``create``: may create a run; ``change``: may change a registered one;
    ``run``: the one run it may name (None: any); ``token``: whose grant, for messages."""

    create: bool = True
    change: bool = True
    run: str | None = None
    token: str | None = None

    ANY: ClassVar[Grant]

    def check_name(self, name: str) -> None:
        if self.run is not None and name != self.run:
            raise Forbidden(
                f"token {self.token} is bound to run {self.run!r}, not to run {name!r}", "name"
            )

    def check_create(self, name: str) -> None:
        if not self.create:
            raise Forbidden(
                f"token {self.token} is an ingest token bound to no run, so it cannot create "
                f"run {name!r}: register the run with an admin token first, or use an "
                "ingest token bound to it"
            )

    def check_change(self, name: str, changes: Sequence[str]) -> None:
        if changes and not self.change:
            raise Forbidden(
                f"token {self.token} is an ingest token and cannot change run {name!r} "
                f"({'; '.join(changes)}): register the same spec, or change it with an "
                "admin token"
            )


Grant.ANY = Grant()
