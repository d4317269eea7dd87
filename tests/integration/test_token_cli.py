"""``steptally token create / list / revoke`` as real subprocesses, on SQLite and
PostgreSQL: the secret alone on stdout's last line and nowhere in the database or the
listing, a revoked token refused by a service built afterwards and by one already up."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import sqlalchemy as sa

from steptally.service.auth.tokens import TokenStore, parse
from steptally.service.store.engine import make_engine


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "steptally.service.cli", "token", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_create_list_revoke(db_url: str, make_client: Any) -> None:
    created = cli("create", "--database-url", db_url, "--scope", "read", "--label", "grafana")
    assert created.returncode == 0, created.stderr
    lines = created.stdout.splitlines()
    secret = lines[-1]
    parts = parse(secret)
    assert parts is not None, created.stdout
    token_id = parts[0]
    assert lines[:-1] == [f"created token {token_id} (scope read); its secret, shown once:"]

    bound = cli("create", "--database-url", db_url, "--scope", "ingest", "--run", "grpo-8b")
    assert bound.returncode == 0, bound.stderr
    bound_id = (parse(bound.stdout.splitlines()[-1]) or ("", ""))[0]

    listed = cli("list", "--database-url", db_url)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()[1:]]
    assert [(r[0], r[1], r[2], r[-1]) for r in rows] == [
        (token_id, "read", "-", "grafana"),
        (bound_id, "ingest", "grpo-8b", "-"),
    ]
    assert secret not in listed.stdout and parts[1] not in listed.stdout

    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            stored = repr(conn.exec_driver_sql("SELECT * FROM tokens").fetchall())
    finally:
        engine.dispose()
    assert parts[1] not in stored

    _, client = make_client(auth=True)  # a service already up
    h = {"Authorization": f"Bearer {secret}"}
    assert client.get("/v1/runs", headers=h).status_code == 200
    revoked = cli("revoke", "--database-url", db_url, token_id)
    assert revoked.returncode == 0, revoked.stderr
    assert revoked.stdout.startswith(f"revoked token {token_id} at ")
    assert client.get("/v1/runs", headers=h).status_code == 401
    tokens = TokenStore(make_engine(db_url))
    try:
        assert tokens.verify(secret) is None
        assert [t.active for t in tokens.list()] == [False, True]
    finally:
        tokens.close()


def test_mistakes_are_one_line_and_a_non_zero_exit(db_url: str) -> None:
    cases = [
        (["create", "--scope", "owner"], 2, "steptally: --scope must be admin, ingest or read"),
        (["create", "--scope", "admin", "--run", "r"], 2, "steptally: an admin token is never"),
        (["create", "--scope", "read", "--run", "a b"], 2, "steptally: --run 'a b' is not"),
        (["revoke", "0123456789abcdef"], 1, "steptally: no token has the id '0123456789abcdef'"),
    ]
    for args, status, start in cases:
        done = cli(*args, "--database-url", db_url)
        assert (done.returncode, done.stdout) == (status, ""), args
        assert done.stderr.startswith(start), done.stderr
        assert len(done.stderr.splitlines()) == 1
    tokens = TokenStore(make_engine(db_url))
    try:
        assert tokens.list() == []
    finally:
        tokens.close()


def test_an_unmigrated_database_names_the_command(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.sqlite3'}"
    done = cli("create", "--database-url", url, "--scope", "read")
    assert done.returncode == 2
    assert "run `steptally migrate" in done.stderr
