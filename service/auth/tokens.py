"""Scoped bearer tokens: create, list, revoke and verify; only a hash is ever stored.

A token reads ``stt_<id>_<secret>``: ``id`` is 16 hex digits that name the row (shown
by ``steptally token list``, given to ``steptally token revoke``), ``secret`` 32 bytes
from :mod:`secrets` in URL-safe base64 (256 bits). The table keeps
``HMAC-SHA256(secret)`` and never the clear secret, which exists only in the answer to
:meth:`TokenStore.create`. A secret of 256 random bits cannot be guessed nor searched
for from its hash, so a fast keyed hash is as safe as a slow password hash (argon2,
bcrypt) would be, and costs microseconds instead of tens of milliseconds on every
request.

:meth:`TokenStore.verify` reads the row on every call (one primary-key lookup), with
no cache: a revoked token is refused by every replica from its next request on.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from sqlalchemy import Engine, RowMapping, Table, insert, select, update

from steptally.service.settings import Settings, database_limits
from steptally.service.store.engine import make_engine, transaction
from steptally.service.store.models import AuthToken

TOKENS: Table = AuthToken.__table__  # type: ignore[assignment]
PREFIX = "stt_"
_FORMAT = re.compile(r"stt_([0-9a-f]{16})_([A-Za-z0-9_-]{43})")
_KEY = b"steptally token v1"  # domain separation: these digests serve nothing else


class Scope(StrEnum):
    """What a token may do: ``admin`` everything, ``ingest`` post fragments, ``read`` read."""

    ADMIN = "admin"
    INGEST = "ingest"
    READ = "read"


@dataclass(frozen=True, slots=True)
class Token:
    """A token as stored (never its secret); ``run`` None: not bound to a run."""

    id: str
    scope: Scope
    run: str | None
    label: str | None
    created_at: float
    revoked_at: float | None

    @property
    def active(self) -> bool:
        return self.revoked_at is None


@dataclass(frozen=True, slots=True)
class Created:
    """A new token and its secret: the one time the secret is known."""

    token: Token
    secret: str


class UnknownToken(LookupError):
    """No token has this id."""


def digest(token_id: str, secret: str) -> str:
    """The stored form of a secret: HMAC-SHA256 over the id and the secret, in hex."""
    message = f"{token_id}:{secret}".encode()
    return hmac.new(_KEY, message, hashlib.sha256).hexdigest()


def parse(text: str) -> tuple[str, str] | None:
    """``(id, secret)`` of a well-formed token, else None."""
    match = _FORMAT.fullmatch(text)
    return (match[1], match[2]) if match else None


class TokenStore:
    """The ``tokens`` table over one engine (the service's database)."""

    def __init__(self, engine: Engine, clock: Callable[[], float] = time.time) -> None:
        self.engine = engine
        self._clock = clock

    def create(self, scope: Scope, run: str | None = None, label: str | None = None) -> Created:
        if scope is Scope.ADMIN and run is not None:
            raise ValueError("an admin token is never bound to a run; leave out the run")
        token_id, secret = secrets.token_hex(8), secrets.token_urlsafe(32)
        token = Token(token_id, scope, run, label, self._clock(), None)
        row = {
            "id": token_id,
            "secret_hash": digest(token_id, secret),
            "scope": scope.value,
            "run": run,
            "label": label,
            "created_at": token.created_at,
            "revoked_at": None,
        }
        with transaction(self.engine, write=True) as conn:
            conn.execute(insert(TOKENS).values(**row))
        return Created(token, f"{PREFIX}{token_id}_{secret}")

    def list(self) -> list[Token]:
        """Every token, revoked ones too, oldest first."""
        query = select(TOKENS).order_by(TOKENS.c.created_at, TOKENS.c.id)
        with transaction(self.engine, write=False) as conn:
            return [_token(row) for row in conn.execute(query).mappings()]

    def revoke(self, token_id: str) -> Token:
        """Revoke ``token_id`` now (revoking it again keeps the first time)."""
        with transaction(self.engine, write=True) as conn:
            conn.execute(
                update(TOKENS)
                .where(TOKENS.c.id == token_id, TOKENS.c.revoked_at.is_(None))
                .values(revoked_at=self._clock())
            )
            row = conn.execute(select(TOKENS).where(TOKENS.c.id == token_id)).mappings().first()
        if row is None:
            raise UnknownToken(f"no token has the id {token_id!r} (`steptally token list`)")
        return _token(row)

    def verify(self, text: str) -> Token | None:
        """The active token whose secret is ``text``, else None (unknown, revoked, malformed)."""
        parts = parse(text)
        if parts is None:
            return None
        token_id, secret = parts
        with transaction(self.engine, write=False) as conn:
            row = conn.execute(select(TOKENS).where(TOKENS.c.id == token_id)).mappings().first()
        if row is None or row["revoked_at"] is not None:
            return None
        if not hmac.compare_digest(row["secret_hash"], digest(token_id, secret)):
            return None
        return _token(row)

    def close(self) -> None:
        self.engine.dispose()


def open_tokens(settings: Settings) -> TokenStore | None:
    """The token store when auth is on (its own engine over the service's database)."""
    if not settings.auth:
        return None
    return TokenStore(make_engine(settings.database_url, database_limits(settings)))


def _token(r: RowMapping) -> Token:
    return Token(r["id"], Scope(r["scope"]), r["run"], r["label"], r["created_at"], r["revoked_at"])
