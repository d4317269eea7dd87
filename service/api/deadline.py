"""A deadline on every request: an answer within ``request_timeout_s``, whatever hangs.

Statement, pool and connect timeouts bound the waits the database driver can see.
Some hangs it cannot: a PostgreSQL backend that is stopped (``SIGSTOP``, a frozen VM)
never runs its statement timeout and never answers a cancel request, while its TCP
connection stays up. So the service bounds the request itself: a request with no
answer started after ``request_timeout_s`` gets 503 ``unavailable`` with
``Retry-After``, and its handler is cancelled.

The database work of a cancelled handler may still be running in its thread, and may
still commit: that is safe, because ingest is idempotent (a client retrying the same
fragments is answered as duplicates) and an answer is only ever sent for what is
durable. Event streams (``…/events``) live for as long as their client listens and
are left alone; their headers go out at once.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from steptally.service.api.errors import answer_error
from steptally.service.errors import Unavailable

STREAM_SUFFIX = "/events"


class AnswerWatch:
    """``send`` that notes whether the answer has started (its ``http.response.start``
    went out): after that, an error can no longer be answered."""

    __slots__ = ("send", "started")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        await self.send(message)


def late(seconds: float) -> Unavailable:
    """The error of a request with no answer started within ``seconds``."""
    return Unavailable(
        f"no answer within the service's request timeout ({seconds:g} s): "
        "the database is not responding; retry"
    )


class RequestDeadline:
    """Answers 503 ``unavailable`` when no answer has started by the deadline."""

    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or str(scope.get("path", "")).endswith(STREAM_SUFFIX):
            await self.app(scope, receive, send)
            return
        watched = AnswerWatch(send)
        try:  # in the request's own task (``wait_for`` would start one per request)
            async with asyncio.timeout(self.seconds):
                await self.app(scope, receive, watched)
        except TimeoutError:
            if watched.started:
                raise  # half an answer went out: nothing else can be said
            await answer_error(Request(scope), late(self.seconds))(scope, receive, send)
