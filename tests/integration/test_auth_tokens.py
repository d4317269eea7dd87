"""Scoped tokens with auth on, on SQLite and PostgreSQL: hashed at rest, 401 vs 403,
the scope matrix, run binding, what an ingest token may register, revocation seen at
once by another replica, the event stream's cookie, and auth off by default."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from steptally.service.auth.tokens import Scope, TokenStore, digest, parse
from steptally.service.store.engine import make_engine

SPEC = {"name": "r", "world_size": 1, "metrics": {"a": "sum"}, "step_timeout_s": 60.0}
BATCH = {
    "fragments": [{"step": 0, "rank": 0, "seq": 0, "values": {"a": 1.5}}],
    "commits": [{"step": 0, "rank": 0, "fragments": 1}],
}


@pytest.fixture
def tokens(db_url: str) -> Any:
    store = TokenStore(make_engine(db_url))
    yield store
    store.close()


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def error_of(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


def test_tokens_are_stored_hashed(db_url: str, tokens: TokenStore) -> None:
    created = tokens.create(Scope.INGEST, run="r", label="job 7")
    token_id, secret = parse(created.secret) or ("", "")
    assert token_id == created.token.id and len(secret) == 43
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = [tuple(r) for r in conn.exec_driver_sql("SELECT * FROM tokens")]
    finally:
        engine.dispose()
    assert len(rows) == 1
    stored = " ".join(str(v) for v in rows[0])
    assert secret not in stored and created.secret not in stored
    columns = dict(zip(["id", "secret_hash", "scope", "run", "label"], rows[0], strict=False))
    assert columns == {
        "id": token_id,
        "secret_hash": digest(token_id, secret),
        "scope": "ingest",
        "run": "r",
        "label": "job 7",
    }
    assert tokens.verify(created.secret) == created.token
    assert tokens.verify(f"stt_{token_id}_{'A' * 43}") is None  # right id, wrong secret


def test_no_token_is_401_and_a_wrong_scope_is_403(make_client: Any, tokens: TokenStore) -> None:
    _, client = make_client(auth=True)
    read = tokens.create(Scope.READ).secret

    missing = client.get("/v1/runs")
    assert error_of(missing) == (401, "unauthenticated")
    assert missing.headers["www-authenticate"] == 'Bearer realm="steptally"'

    for bad in ("nonsense", "stt_0123456789abcdef_" + "x" * 43, read + "x"):
        answer = client.get("/v1/runs", headers=bearer(bad))
        assert error_of(answer) == (401, "unauthenticated")
        assert answer.headers["www-authenticate"] == (
            'Bearer realm="steptally", error="invalid_token"'
        )
    basic = client.get("/v1/runs", headers={"Authorization": "Basic dXNlcjpwYXNz"})
    assert error_of(basic) == (401, "unauthenticated")

    forbidden = client.post("/v1/runs", json=SPEC, headers=bearer(read))
    assert error_of(forbidden) == (403, "forbidden")
    assert "www-authenticate" not in forbidden.headers
    assert "read scope and cannot register runs" in forbidden.json()["error"]["message"]
    assert client.get("/v1/runs", headers=bearer(read)).json()["runs"] == []  # nothing made


def test_scope_matrix(make_client: Any, tokens: TokenStore) -> None:
    _, client = make_client(auth=True)
    admin = tokens.create(Scope.ADMIN).secret
    ingest = tokens.create(Scope.INGEST).secret
    read = tokens.create(Scope.READ).secret
    assert client.post("/v1/runs", json=SPEC, headers=bearer(admin)).status_code == 201
    routes = [
        ("POST", "/v1/runs/r/fragments", BATCH),
        ("GET", "/v1/runs", None),
        ("GET", "/v1/runs/r", None),
        ("GET", "/v1/runs/r/steps", None),
        ("GET", "/v1/runs/r/steps/0", None),
        ("GET", "/v1/runs/r/series/a", None),
        ("GET", "/metrics", None),
        ("GET", "/readyz", None),
    ]
    seen = {}
    for who, secret in (("admin", admin), ("ingest", ingest), ("read", read), ("none", None)):
        for method, path, body in routes:
            headers = bearer(secret) if secret else {}
            answer = client.request(method, path, json=body, headers=headers)
            seen[who, method, path] = answer.status_code
    expected = {}
    for method, path, _ in routes:
        posting = method == "POST"
        expected["admin", method, path] = 200
        expected["ingest", method, path] = 200 if posting else 403
        expected["read", method, path] = 403 if posting else 200
        expected["none", method, path] = 401
    assert seen == expected
    # open to anyone: the process's health, the dashboard's pages and scripts, the API docs
    for path in ("/healthz", "/", "/runs/r", "/dashboard/static/api.js", "/docs", "/openapi.json"):
        assert client.get(path).status_code == 200, path


def test_run_binding(make_client: Any, tokens: TokenStore) -> None:
    _, client = make_client(auth=True)
    admin = tokens.create(Scope.ADMIN).secret
    for name in ("r", "other"):
        spec = {**SPEC, "name": name}
        assert client.post("/v1/runs", json=spec, headers=bearer(admin)).status_code == 201
    ingest = tokens.create(Scope.INGEST, run="r")
    read = tokens.create(Scope.READ, run="r").secret
    h = bearer(ingest.secret)
    assert client.post("/v1/runs/r/fragments", json=BATCH, headers=h).status_code == 200
    refused = client.post("/v1/runs/other/fragments", json=BATCH, headers=h)
    assert error_of(refused) == (403, "forbidden")
    assert refused.json()["error"]["message"] == (
        f"token {ingest.token.id} is bound to run 'r', not to run 'other'"
    )
    assert client.get("/v1/runs/r/steps/0", headers=bearer(read)).json()["status"] == "complete"
    for path in ("/v1/runs/other", "/v1/runs/other/steps/0", "/v1/runs", "/metrics"):
        assert error_of(client.get(path, headers=bearer(read))) == (403, "forbidden"), path
    assert client.get("/readyz", headers=bearer(read)).status_code == 200
    other = client.get("/v1/runs/other/steps/0", headers=bearer(admin))
    assert error_of(other) == (404, "unknown_step")  # the refused batch stored nothing


def test_ingest_tokens_never_change_a_spec(make_client: Any, tokens: TokenStore) -> None:
    _, client = make_client(auth=True)
    admin = bearer(tokens.create(Scope.ADMIN).secret)
    unbound = bearer(tokens.create(Scope.INGEST).secret)
    bound = bearer(tokens.create(Scope.INGEST, run="mine").secret)

    new = client.post("/v1/runs", json=SPEC, headers=unbound)
    assert error_of(new) == (403, "forbidden")
    assert "cannot create run 'r'" in new.json()["error"]["message"]
    assert client.post("/v1/runs", json=SPEC, headers=admin).status_code == 201
    assert client.post("/v1/runs", json=SPEC, headers=unbound).status_code == 200  # the same

    wider = {**SPEC, "metrics": {"a": "sum", "b": "count"}}
    slower = {**SPEC, "step_timeout_s": 600.0}
    for change, why in ((wider, "it would add b"), (slower, "step_timeout_s is 60, not 600")):
        answer = client.post("/v1/runs", json=change, headers=unbound)
        assert error_of(answer) == (403, "forbidden")
        assert why in answer.json()["error"]["message"]
    run = client.get("/v1/runs/r", headers=admin).json()
    assert (run["metrics"], run["step_timeout_s"]) == ({"a": "sum"}, 60.0)

    mine = {**SPEC, "name": "mine"}
    assert client.post("/v1/runs", json=mine, headers=bound).status_code == 201
    assert client.post("/v1/runs", json=mine, headers=bound).status_code == 200
    elsewhere = client.post("/v1/runs", json=SPEC, headers=bound)
    assert error_of(elsewhere) == (403, "forbidden")
    assert elsewhere.json()["error"]["where"] == "name"
    assert client.post("/v1/runs", json=wider, headers=admin).status_code == 200  # admin may


def test_revoking_holds_at_once_on_every_replica(make_client: Any, tokens: TokenStore) -> None:
    _, one = make_client(auth=True)
    _, two = make_client(auth=True)
    created = tokens.create(Scope.READ)
    h = bearer(created.secret)
    assert one.get("/v1/runs", headers=h).status_code == 200
    assert two.get("/v1/runs", headers=h).status_code == 200
    revoked = tokens.revoke(created.token.id)
    assert revoked.revoked_at is not None and not revoked.active
    assert error_of(one.get("/v1/runs", headers=h)) == (401, "unauthenticated")
    assert error_of(two.get("/v1/runs", headers=h)) == (401, "unauthenticated")
    assert [t.id for t in tokens.list() if not t.active] == [created.token.id]


def test_event_stream_takes_the_cookie_and_nothing_else_does(
    make_client: Any, tokens: TokenStore
) -> None:
    _, client = make_client(auth=True)
    admin = bearer(tokens.create(Scope.ADMIN).secret)
    read = tokens.create(Scope.READ).secret
    assert client.post("/v1/runs", json=SPEC, headers=admin).status_code == 201
    client.cookies.set("steptally_token", read)
    try:
        with client.stream("GET", "/v1/runs/r/events") as stream:
            assert stream.status_code == 200
            assert stream.headers["content-type"].startswith("text/event-stream")
        assert error_of(client.get("/v1/runs/r")) == (401, "unauthenticated")
        client.cookies.set("steptally_token", "stt_0000000000000000_" + "y" * 43)
        refused = client.get("/v1/runs/r/events")
        assert error_of(refused) == (401, "unauthenticated")
    finally:
        client.cookies.clear()


def test_auth_is_off_by_default(client: TestClient) -> None:
    assert client.post("/v1/runs", json=SPEC).status_code == 201
    assert client.post("/v1/runs/r/fragments", json=BATCH).status_code == 200
    assert client.get("/v1/runs/r/steps/0").json()["status"] == "complete"


def test_the_api_description_declares_the_bearer_token(make_client: Any) -> None:
    _, on = make_client(auth=True)
    described = on.get("/openapi.json").json()
    assert described["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert described["security"] == [{"bearer": []}]
    _, off = make_client()
    plain = off.get("/openapi.json").json()
    assert "security" not in plain and "securitySchemes" not in plain.get("components", {})
