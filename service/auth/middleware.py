"""The guard in front of every route: rate limit, then token, then scope.

With auth on (``STEPTALLY_AUTH=on``) a request that needs a scope
(:func:`~steptally.service.auth.policy.need_of`) must carry
``Authorization: Bearer <token>``; the event stream also takes the token from the
``steptally_token`` cookie, since a browser's ``EventSource`` cannot set headers.
No token, or one that is unknown, revoked or malformed: 401 ``unauthenticated`` with
``WWW-Authenticate: Bearer``. A valid token without the scope, or bound to another
run: 403 ``forbidden``. The token is verified against the database on every request
(no cache), so a revocation holds at once on every replica; an event stream that is
already open checks its token again every ``recheck_s`` seconds and is ended once the
token is revoked (the browser's reconnect is then refused).

The rate limit counts each valid token's requests in its own bucket; everything else
(auth off, open routes, requests without a valid token) counts per client address.
An address whose bucket is empty is refused before its token is even looked up, so
a flood of bad tokens costs no database work. Over the limit: 429 ``rate_limited``
with ``Retry-After``. ``/healthz`` is never limited.

What the token may register is left on the request (``request.state.grant``) for
``POST /v1/runs``, which decides with the body and the stored run.
"""

from __future__ import annotations

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request, cookie_parser
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from steptally.service.api.errors import DATABASE_AWAY, answer_error
from steptally.service.auth.grant import Grant
from steptally.service.auth.policy import grant_of, need_of, refusal
from steptally.service.auth.ratelimit import RateLimiter, retry_after
from steptally.service.auth.tokens import Token, TokenStore
from steptally.service.errors import (
    Forbidden,
    RateLimited,
    ServiceError,
    Unauthenticated,
    Unavailable,
)

COOKIE = "steptally_token"
RECHECK_S = 5.0  # how often an open event stream's token is verified again
GRANT = "grant"  # the key in the request's state
_MISSING = (
    "this route needs a token: send the header 'Authorization: Bearer <token>' "
    "(`steptally token create` makes one)"
)
_INVALID = "the token is not valid (unknown, revoked or malformed); ask for a new one"


class Guard:
    """ASGI middleware; ``tokens`` None: auth off; ``limiter`` None: no rate limit."""

    def __init__(
        self,
        app: ASGIApp,
        tokens: TokenStore | None,
        limiter: RateLimiter | None,
        recheck_s: float = RECHECK_S,
    ) -> None:
        self.app = app
        self.tokens = tokens
        self.limiter = limiter
        self.recheck_s = recheck_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            token = await self._admit(scope)
        except ServiceError as exc:
            await answer_error(Request(scope), exc)(scope, receive, send)
            return
        grant: Grant = grant_of(token)
        scope.setdefault("state", {})[GRANT] = grant
        if token is not None and need_of(scope["method"], scope["path"]).cookie:
            await self._stream(token, scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _stream(self, token: Token, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve an event stream while ``token`` stays valid; end it once revoked."""
        assert self.tokens is not None
        tokens, credential = self.tokens, _credential(scope, cookie=True) or ""

        async def watch(cancel: anyio.CancelScope) -> None:
            while True:
                await anyio.sleep(self.recheck_s)
                try:
                    valid = await run_in_threadpool(tokens.verify, credential)
                except DATABASE_AWAY:
                    continue  # the database is away: not a revocation
                if valid is None:
                    cancel.cancel()
                    return

        state = {"started": False, "done": False}

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                state["done"] = True
            await send(message)

        async with anyio.create_task_group() as group:
            group.start_soon(watch, group.cancel_scope)
            await self.app(scope, receive, tracked)
            group.cancel_scope.cancel()
        if state["started"] and not state["done"]:  # ended by a revocation: end it cleanly
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _admit(self, scope: Scope) -> Token | None:
        path: str = scope["path"]
        if path == "/healthz":
            return None
        need = need_of(scope["method"], path)
        address = address_of(scope)
        if self.tokens is None or need.scope is None:
            self._limit(address, "from this address")
            return None
        credential = _credential(scope, need.cookie)
        if credential is None:
            self._limit(address, "from this address")
            raise Unauthenticated(_MISSING)
        self._hold_off(address)
        try:
            token = await run_in_threadpool(self.tokens.verify, credential)
        except DATABASE_AWAY as exc:
            raise Unavailable(
                f"the database did not answer in time ({type(exc).__name__}); retry"
            ) from None
        if token is None:
            self._limit(address, "from this address")
            raise Unauthenticated(_INVALID, invalid=True)
        self._limit(f"token:{token.id}", f"for token {token.id}")
        reason = refusal(token, need)
        if reason is not None:
            raise Forbidden(reason)
        return token

    def _limit(self, key: str, whose: str) -> None:
        if self.limiter is None:
            return
        wait = self.limiter.take(key)
        if wait > 0:
            raise self._too_many(wait, whose)

    def _hold_off(self, address: str) -> None:
        """Refuse an address that is over its limit before looking its token up."""
        if self.limiter is not None:
            wait = self.limiter.wait_of(address)
            if wait > 0:
                raise self._too_many(wait, "from this address")

    def _too_many(self, wait: float, whose: str) -> RateLimited:
        assert self.limiter is not None
        after = retry_after(wait)
        return RateLimited(
            f"too many requests {whose}: the limit is {self.limiter.rate:g} per second "
            f"(bursts of {self.limiter.burst}); retry after {after} s",
            after,
        )


def address_of(scope: Scope) -> str:
    client = scope.get("client")
    return f"address:{client[0] if client else 'unknown'}"


def _credential(scope: Scope, cookie: bool) -> str | None:
    """The bearer token of the request, or (``cookie``) of its ``steptally_token`` cookie."""
    cookies = None
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    for name, value in headers:
        if name == b"authorization":
            scheme, _, rest = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and rest.strip():
                return rest.strip()
        elif name == b"cookie" and cookie:
            cookies = value.decode("latin-1")
    if cookies is not None:
        found: str | None = cookie_parser(cookies).get(COOKIE)
        return found or None
    return None
