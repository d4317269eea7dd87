"""The route policy (pure): what each request needs and why a token is refused; and the
reporter's reading of 401 and 403 as a refusal of its token."""

from __future__ import annotations

import httpx

from steptally.client.reporter.sender import Outcome, classify
from steptally.service.auth.grant import Grant
from steptally.service.auth.policy import OPEN, Need, grant_of, need_of, refusal
from steptally.service.auth.tokens import Scope, Token, parse


def token(scope: Scope, run: str | None = None) -> Token:
    return Token("0123456789abcdef", scope, run, None, 0.0, None)


def test_what_each_route_needs() -> None:
    assert {
        (m, p): need_of(m, p)
        for m, p in [
            ("GET", "/healthz"),
            ("POST", "/healthz"),
            ("GET", "/"),
            ("GET", "/runs/r"),
            ("GET", "/dashboard/static/api.js"),
            ("GET", "/docs"),
            ("GET", "/openapi.json"),
            ("POST", "/v1/runs"),
            ("GET", "/v1/runs"),
            ("POST", "/v1/runs/r/fragments"),
            ("GET", "/v1/runs/r"),
            ("HEAD", "/v1/runs/r/steps/3"),
            ("GET", "/v1/runs/r/events"),
            ("DELETE", "/v1/runs/r"),
            ("GET", "/metrics"),
            ("GET", "/readyz"),
            ("GET", "/elsewhere"),
            ("POST", "/"),
        ]
    } == {
        ("GET", "/healthz"): OPEN,
        ("POST", "/healthz"): OPEN,
        ("GET", "/"): OPEN,
        ("GET", "/runs/r"): OPEN,
        ("GET", "/dashboard/static/api.js"): OPEN,
        ("GET", "/docs"): OPEN,
        ("GET", "/openapi.json"): OPEN,
        ("POST", "/v1/runs"): Need(Scope.ADMIN, register=True),
        ("GET", "/v1/runs"): Need(Scope.READ, every_run=True),
        ("POST", "/v1/runs/r/fragments"): Need(Scope.INGEST, "r"),
        ("GET", "/v1/runs/r"): Need(Scope.READ, "r"),
        ("HEAD", "/v1/runs/r/steps/3"): Need(Scope.READ, "r"),
        ("GET", "/v1/runs/r/events"): Need(Scope.READ, "r", cookie=True),
        ("DELETE", "/v1/runs/r"): Need(Scope.ADMIN, "r"),
        ("GET", "/metrics"): Need(Scope.READ, every_run=True),
        ("GET", "/readyz"): Need(Scope.READ),
        ("GET", "/elsewhere"): Need(Scope.READ),
        ("POST", "/"): Need(Scope.ADMIN),
    }


def test_refusals_name_the_token_and_what_it_lacks() -> None:
    fragments, step = Need(Scope.INGEST, "r"), Need(Scope.READ, "r")
    assert refusal(token(Scope.ADMIN), Need(Scope.ADMIN)) is None
    assert refusal(token(Scope.ADMIN), step) is None
    assert refusal(token(Scope.INGEST), fragments) is None
    assert refusal(token(Scope.INGEST, "r"), fragments) is None
    assert refusal(token(Scope.INGEST, "q"), fragments) == (
        "token 0123456789abcdef is bound to run 'q', not to run 'r'"
    )
    assert refusal(token(Scope.INGEST), step) == (
        "token 0123456789abcdef has the ingest scope and cannot read (a read token does)"
    )
    assert refusal(token(Scope.READ), fragments) == (
        "token 0123456789abcdef has the read scope and cannot post fragments (an ingest token does)"
    )
    assert refusal(token(Scope.READ, "r"), Need(Scope.READ, every_run=True)) == (
        "token 0123456789abcdef is bound to run 'r' and cannot read every run; "
        "read /v1/runs/r or use a token bound to no run"
    )
    assert refusal(token(Scope.READ, "r"), Need(Scope.READ)) is None  # /readyz
    assert refusal(token(Scope.INGEST), Need(Scope.ADMIN, register=True)) is None
    assert refusal(token(Scope.READ), Need(Scope.ADMIN, "r")) == (
        "token 0123456789abcdef has the read scope and cannot do this (an admin token does)"
    )


def test_grants() -> None:
    assert grant_of(None) is Grant.ANY
    assert grant_of(token(Scope.ADMIN)) is Grant.ANY
    assert grant_of(token(Scope.INGEST)) == Grant(False, False, None, "0123456789abcdef")
    assert grant_of(token(Scope.INGEST, "r")) == Grant(True, False, "r", "0123456789abcdef")


def test_token_format() -> None:
    secret = "A" * 43
    assert parse(f"stt_0123456789abcdef_{secret}") == ("0123456789abcdef", secret)
    for bad in ("", "stt_", f"stt_0123456789ABCDEF_{secret}", f"stt_0123456789abcdef_{secret}x"):
        assert parse(bad) is None, bad


def test_the_reporter_reads_401_and_403_as_its_token_refused() -> None:
    def answer(status: int, code: str) -> Outcome:
        body = {"error": {"code": code, "message": "m", "where": None}}
        return classify(httpx.Response(status, json=body)).outcome

    assert answer(401, "unauthenticated") is Outcome.DENIED
    assert answer(403, "forbidden") is Outcome.DENIED
    assert answer(429, "rate_limited") is Outcome.RETRY
    assert answer(409, "spec_conflict") is Outcome.REJECT
