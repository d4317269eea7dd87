"""The background sweeper: finalise overdue open steps as partial, periodically.

It runs as an asyncio task in the app's lifespan and does its database work in the
thread pool. Several instances may sweep one database: the store's row lock makes
each finalisation happen once.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.concurrency import run_in_threadpool

from steptally.service.usecase.service import Service

log = logging.getLogger(__name__)


async def sweep_forever(service: Service, interval_s: float) -> None:
    """Sweep every ``interval_s`` seconds until cancelled; errors are logged, not fatal."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await run_in_threadpool(service.sweep)
        except Exception:  # a database hiccup must not stop the sweeper for good
            log.exception("sweeping overdue steps failed; retrying in %.1fs", interval_s)
