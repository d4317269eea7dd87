"""Access control: scoped bearer tokens and per-client rate limits.

    tokens.py      the token table: create, list, revoke, verify (hashed at rest)
    policy.py      which scope each route needs; why a token is refused
    grant.py       what a token may register (checked with the body)
    ratelimit.py   token buckets per token or per client address
    middleware.py  the ASGI guard that puts them in front of every route

``STEPTALLY_AUTH=on`` switches tokens on; the rate limit is on either way
(``docs/security.md``).
"""
