"""The one place that talks HTTP: register the run, post a parcel, classify the answer.

Everything goes through one ``httpx.Client`` whose transport is injectable, so tests
use ``httpx.MockTransport`` and the real service alike. Parcels are posted with
``?partial=true``: the service stores what is right and names each fragment or
commit it refused (:class:`Refused`), so one bad item never costs the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

import httpx

from steptally.client.reporter.retry import is_retryable, parse_retry_after


class Outcome(Enum):
    OK = "ok"
    RETRY = "retry"  # may pass: connection error, 5xx, 408, 429
    REJECT = "reject"  # final: any other 4xx
    DENIED = "denied"  # final: 401/403, the token is refused; nothing more can be delivered
    UNKNOWN_RUN = "unknown_run"  # the service forgot the run: register again


@dataclass(frozen=True, slots=True)
class Refused:
    """One item of a delivered parcel the service refused for good; ``seq`` None: a commit."""

    step: int
    rank: int
    seq: int | None
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Answer:
    outcome: Outcome
    status: int | None = None
    code: str | None = None
    message: str = ""
    retry_after: float | None = None
    refused: tuple[Refused, ...] = ()
    duplicates: int = 0  # fragments the service already had (a delivered parcel)


class Sender:
    def __init__(
        self,
        url: str,
        run: str,
        registration: dict[str, Any],
        token: str | None = None,
        transport: httpx.BaseTransport | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.base = url.rstrip("/")
        self.run = run
        self.registration = registration
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self._transport = transport
        self._timeout = timeout_s
        self._client: httpx.Client | None = None

    def client(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(
                transport=self._transport, timeout=self._timeout, headers=self._headers
            )
        return self._client

    def reset_after_fork(self) -> None:
        """A forked child must not share the parent's connections: start a new client."""
        self._client = None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def register(self) -> Answer:
        return self._request("POST", "/v1/runs", json=self.registration)

    def post(self, body: bytes, headers: dict[str, str]) -> Answer:
        return self._request(
            "POST",
            f"/v1/runs/{self.run}/fragments",
            content=body,
            headers=headers,
            params={"partial": "true"},
        )

    def _request(self, method: str, path: str, **kwargs: Any) -> Answer:
        try:
            response = self.client().request(method, self.base + path, **kwargs)
        except httpx.TransportError as exc:
            return Answer(Outcome.RETRY, message=f"{type(exc).__name__}: {exc}".rstrip(": "))
        except httpx.HTTPError as exc:  # e.g. an invalid url: retrying will not help
            return Answer(Outcome.REJECT, message=f"{type(exc).__name__}: {exc}")
        return classify(response)


def classify(response: httpx.Response) -> Answer:
    status = response.status_code
    if 200 <= status < 300:
        return Answer(
            Outcome.OK, status, refused=_refused_of(response), duplicates=_duplicates_of(response)
        )
    code, message = _error_of(response)
    if is_retryable(status):
        after = parse_retry_after(response.headers.get("retry-after"))
        return Answer(Outcome.RETRY, status, code, message, after)
    if status in (401, 403):
        return Answer(Outcome.DENIED, status, code, message)
    if status == 404 and code == "unknown_run":
        return Answer(Outcome.UNKNOWN_RUN, status, code, message)
    return Answer(Outcome.REJECT, status, code, message)


def _duplicates_of(response: httpx.Response) -> int:
    try:
        body = json.loads(response.read() or b"null")
    except ValueError:
        return 0
    n = body.get("duplicates") if isinstance(body, dict) else None
    return n if isinstance(n, int) else 0


def _refused_of(response: httpx.Response) -> tuple[Refused, ...]:
    """The ``rejected`` items of a partial ingest's answer (none in any other answer)."""
    try:
        body = json.loads(response.read() or b"null")
    except ValueError:
        return ()
    items = body.get("rejected") if isinstance(body, dict) else None
    if not isinstance(items, list):
        return ()
    return tuple(
        Refused(
            int(i.get("step", -1)),
            int(i.get("rank", -1)),
            None if i.get("seq") is None else int(i["seq"]),
            str(i.get("code")),
            str(i.get("message", "")),
        )
        for i in items
        if isinstance(i, dict)
    )


def _error_of(response: httpx.Response) -> tuple[str | None, str]:
    """The machine-readable code and a readable sentence from an error body."""
    text = f"HTTP {response.status_code}"
    try:
        body = json.loads(response.read() or b"null")
    except ValueError:
        snippet = response.text[:200].strip()
        return None, f"{text}: {snippet}" if snippet else text
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return None, f"{text}: {str(body)[:200]}"
    code = error.get("code")
    where = f" (at {error['where']})" if error.get("where") else ""
    return (str(code) if code else None), f"{text} {code}: {error.get('message')}{where}"
