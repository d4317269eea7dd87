"""Which scope each request needs, and whether a token has it. Pure: no I/O.

    route                                   needs
    GET  /healthz                           nothing (always open)
    GET  /, /runs/{run}, /dashboard/*       nothing: the dashboard's pages hold no data;
         /docs, /docs/*, /openapi.json      their scripts read the API with a read token
    POST /v1/runs                           admin; or ingest, to confirm a registered
                                            spec (and a run-bound ingest token may
                                            create its own run), never to change one
    POST /v1/runs/{run}/fragments           ingest (for that run when bound)
    GET  /v1/runs/{run}, …/steps, …/series,
         …/events                           read (for that run when bound)
    GET  /v1/runs, /metrics                 read, not bound to a run (they show every run)
    GET  /readyz                            read
    anything else                           read for GET and HEAD, admin otherwise

``admin`` may do everything. A run-bound token is refused (403) on another run.
"""

from __future__ import annotations

from dataclasses import dataclass

from steptally.service.auth.grant import Grant
from steptally.service.auth.tokens import Scope, Token

_OPEN_PREFIXES = ("/dashboard/", "/docs/", "/runs/")
_OPEN_PATHS = frozenset({"/", "/docs", "/openapi.json"})
_READS = frozenset({"GET", "HEAD"})
EVENTS_SUFFIX = "/events"


@dataclass(frozen=True, slots=True)
class Need:
    """What a request needs: ``scope`` None means open to anyone."""

    scope: Scope | None
    run: str | None = None  # the run the path names
    every_run: bool = False  # reads every run: not for a run-bound token
    register: bool = False  # POST /v1/runs: what may be registered is decided with the body
    cookie: bool = False  # the event stream: the token may come in a cookie (EventSource)


OPEN = Need(None)


def need_of(method: str, path: str) -> Need:
    """The scope that ``method`` on ``path`` needs."""
    read = method in _READS
    if path == "/healthz" or (read and (path in _OPEN_PATHS or path.startswith(_OPEN_PREFIXES))):
        return OPEN
    if path in ("/v1/runs", "/v1/runs/"):
        if read:
            return Need(Scope.READ, every_run=True)
        return Need(Scope.ADMIN, register=method == "POST")
    if path.startswith("/v1/runs/"):
        parts = path.split("/")
        run = parts[3]
        if method == "POST" and parts[4:] == ["fragments"]:
            return Need(Scope.INGEST, run)
        if read:
            return Need(Scope.READ, run, cookie=parts[4:] == ["events"])
        return Need(Scope.ADMIN, run)
    if read:
        return Need(Scope.READ, every_run=path == "/metrics")
    return Need(Scope.ADMIN)


def refusal(token: Token, need: Need) -> str | None:
    """Why ``token`` may not make the request (a sentence for the 403), or None."""
    if token.scope is Scope.ADMIN or need.scope is None:
        return None
    if need.register:
        if token.scope is Scope.INGEST:
            return None  # the registration itself checks what the grant allows
        return _wrong_scope(token, "register runs (an admin token does)")
    if token.scope is not need.scope:
        what = {
            Scope.INGEST: "post fragments (an ingest token does)",
            Scope.READ: "read (a read token does)",
        }.get(need.scope, "do this (an admin token does)")
        return _wrong_scope(token, what)
    if token.run is not None and need.every_run:
        return (
            f"token {token.id} is bound to run {token.run!r} and cannot read every run; "
            f"read /v1/runs/{token.run} or use a token bound to no run"
        )
    if token.run is not None and need.run is not None and need.run != token.run:
        return f"token {token.id} is bound to run {token.run!r}, not to run {need.run!r}"
    return None


def grant_of(token: Token | None) -> Grant:
    """What ``token`` may register (None: auth is off, anything)."""
    if token is None or token.scope is Scope.ADMIN:
        return Grant.ANY
    return Grant(create=token.run is not None, change=False, run=token.run, token=token.id)


def _wrong_scope(token: Token, what: str) -> str:
    return f"token {token.id} has the {token.scope.value} scope and cannot {what}"
