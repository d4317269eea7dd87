"""Rate limits through the app, on SQLite and PostgreSQL: 429 rate_limited JSON with
Retry-After, per token with auth on, per client address without a valid token, and
never on /healthz."""

from __future__ import annotations

from typing import Any

from steptally.service.auth.tokens import Scope, TokenStore
from steptally.service.store.engine import make_engine

SPEC = {"name": "r", "world_size": 1, "metrics": {"a": "sum"}, "step_timeout_s": 60.0}


def test_over_the_limit_is_429_with_retry_after(make_client: Any) -> None:
    _, client = make_client(rate_limit_per_s=0.5, rate_limit_burst=3)
    answers = [client.get("/v1/runs").status_code for _ in range(3)]
    assert answers == [200, 200, 200]
    refused = client.post("/v1/runs", json=SPEC)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "2"  # one request back in 2 s at 0.5 per second
    assert refused.json() == {
        "error": {
            "code": "rate_limited",
            "message": "too many requests from this address: the limit is 0.5 per second "
            "(bursts of 3); retry after 2 s",
            "where": None,
        }
    }
    assert [client.get("/healthz").status_code for _ in range(10)] == [200] * 10
    assert client.get("/v1/runs").status_code == 429
    # the refused registration changed nothing
    _, other = make_client()
    assert other.get("/v1/runs").json()["runs"] == []


def test_each_token_has_its_own_bucket(make_client: Any, db_url: str) -> None:
    tokens = TokenStore(make_engine(db_url))
    try:
        one, two = tokens.create(Scope.READ), tokens.create(Scope.READ)
    finally:
        tokens.close()
    _, client = make_client(auth=True, rate_limit_per_s=0.1, rate_limit_burst=2)
    h1 = {"Authorization": f"Bearer {one.secret}"}
    h2 = {"Authorization": f"Bearer {two.secret}"}
    assert [client.get("/v1/runs", headers=h1).status_code for _ in range(3)] == [200, 200, 429]
    refused = client.get("/v1/runs", headers=h1)
    assert refused.headers["retry-after"] == "10"
    assert refused.json()["error"]["message"].startswith(
        f"too many requests for token {one.token.id}:"
    )
    assert [client.get("/v1/runs", headers=h2).status_code for _ in range(2)] == [200, 200]


def test_bad_tokens_are_held_off_before_any_lookup(make_client: Any) -> None:
    _, client = make_client(auth=True, rate_limit_per_s=0.1, rate_limit_burst=2)
    bad = {"Authorization": "Bearer stt_0123456789abcdef_" + "z" * 43}
    statuses = [client.get("/v1/runs", headers=bad).status_code for _ in range(4)]
    assert statuses == [401, 401, 429, 429]
    assert client.get("/v1/runs").status_code == 429  # the same address, no token either
    assert client.get("/healthz").status_code == 200
