"""An event stream already open when its token is revoked is ended, cleanly, by the
service within the recheck interval (5 s), and reconnecting is refused (401)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from support.served import ServedService

from steptally.service.auth.middleware import RECHECK_S
from steptally.service.auth.tokens import Scope, TokenStore
from steptally.service.store.engine import make_engine


def test_a_revoked_token_ends_its_open_stream(tmp_path: Path) -> None:
    service = ServedService(f"sqlite:///{tmp_path / 'db.sqlite3'}", tmp_path / "service.log")
    tokens = TokenStore(make_engine(service.database_url))
    admin, read = tokens.create(Scope.ADMIN), tokens.create(Scope.READ)
    service.env, service.ready_token = {"STEPTALLY_AUTH": "on"}, read.secret
    service.start()
    try:
        spec = {"name": "s", "world_size": 1, "metrics": {"a": "sum"}}
        h = {"Authorization": f"Bearer {admin.secret}"}
        assert httpx.post(f"{service.url}/v1/runs", json=spec, headers=h).status_code == 201
        cookies = {"steptally_token": read.secret}
        url = f"{service.url}/v1/runs/s/events"
        with httpx.Client(cookies=cookies, timeout=30) as client:
            with client.stream("GET", url) as stream:
                assert stream.status_code == 200
                lines = stream.iter_lines()
                assert next(lines) == ": live"
                tokens.revoke(read.token.id)
                revoked = time.monotonic()
                rest = list(lines)  # the stream ends, cleanly (a last empty chunk)
                ended = time.monotonic() - revoked
            assert ended < RECHECK_S + 2.0
            # the rest of the first message (its id and retry), pings, no event
            assert rest[:2] == ["id: 0.0:0:0", "retry: 1000"]
            assert all(line == "" or line.startswith(":") for line in rest[2:])
            assert client.get(url).status_code == 401
    finally:
        tokens.close()
        service.stop()
