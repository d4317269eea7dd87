"""Fan-out of "step finalised" events between replicas over Redis pub/sub.

With ``STEPTALLY_REDIS_URL`` set, each replica publishes the steps it finalises on one
channel (:mod:`~steptally.service.coordination.keys`) instead of handing them to its
own :class:`~steptally.service.usecase.events.EventHub`; every replica, the publisher
included, subscribes to that channel and delivers what arrives to its hub. So every
replica's event streams see every finalisation, a millisecond or two after its commit.

Redis pub/sub delivers at most once, and Redis may be away. The rule is that events
degrade to *replay on reconnect from the database*, never to an error or lost data:

* while this replica is not subscribed (Redis down, or not yet reached at start), its
  hub is ``degraded``: its streams read each finalisation from the database, woken by
  this replica's own (delivered to its hub directly) and polling for the others'
  (:func:`~steptally.service.usecase.events.step_events`), so they stay live, in the
  database's order, and skip nothing;
* a publish that fails is delivered locally the same way;
* whenever the subscription is lost, and again when it is back, every open stream of
  this replica is ended. Clients (browsers' ``EventSource``, the dashboard) reconnect
  with ``Last-Event-ID`` and replay from the database what they missed meanwhile.

Ingest never waits on Redis: publishing is a hand-off to this replica's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from steptally.service.coordination.keys import RedisKeys
from steptally.service.usecase.events import EventCursor, EventHub, StepEvent

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 1.0
HEALTH_CHECK_S = 2  # the subscription pings Redis when idle this long
RETRY_S = 0.5  # between attempts to subscribe again
POLL_S = 1.0  # the longest one wait for a message lasts
START_WAIT_S = 2.0  # how long the app's start waits for the first subscription
STOP_WAIT_S = 2.0  # how long its shutdown waits for the fan-out to stop

_Outgoing = tuple[str, list[StepEvent], bytes]


def encode(run: str, events: list[StepEvent]) -> bytes:
    """One message: the run and its events, cursor and step object each."""
    items = [[e.cursor.finalised_at, e.cursor.step, e.cursor.revision, e.step] for e in events]
    return orjson.dumps({"run": run, "events": items}, option=orjson.OPT_NON_STR_KEYS)


def decode(message: bytes) -> tuple[str, list[StepEvent]]:
    body: dict[str, Any] = orjson.loads(message)
    events = [StepEvent(EventCursor(at, step, rev), obj) for at, step, rev, obj in body["events"]]
    return str(body["run"]), events


class RedisFanout:
    """The publisher of this replica's finalisations and the subscriber to everyone's."""

    def __init__(self, url: str, keys: RedisKeys, hub: EventHub) -> None:
        self._redis = aioredis.Redis.from_url(
            url,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            health_check_interval=HEALTH_CHECK_S,
        )
        self._channel = keys.finalised_events
        self._hub = hub
        hub.degraded = True  # until the first subscription: it hears only this replica
        self._subscribed = asyncio.Event()
        self._outbox: asyncio.Queue[_Outgoing] = asyncio.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def subscribed(self) -> bool:
        return self._subscribed.is_set()

    def wants(self, run: str) -> bool:
        """Any replica may have a stream of ``run`` open: every event is worth sending."""
        return True

    def publish(self, run: str, events: list[StepEvent]) -> None:
        """Hand ``events`` to the event loop for Redis; callable from any thread."""
        item = (run, events, encode(run, events))
        loop = self._loop
        if loop is None:
            self._hub.publish(run, events)
            return
        try:
            loop.call_soon_threadsafe(self._outbox.put_nowait, item)
        except RuntimeError:  # the loop has closed: the app is stopping
            self._hub.publish(run, events)

    async def start(self) -> None:
        """Start publishing and subscribing; wait a little for the first subscription."""
        self._loop = asyncio.get_running_loop()
        self._tasks = [
            asyncio.create_task(self._send_forever()),
            asyncio.create_task(self._listen_forever()),
        ]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._subscribed.wait(), START_WAIT_S)
        if not self.subscribed:
            log.warning("Redis is not reachable; events stay on this replica until it is")

    async def stop(self) -> None:
        """Stop both tasks and close the client, within ``STOP_WAIT_S`` whatever Redis
        does (a Redis that died mid-command must not hold the app's shutdown)."""
        self._loop = None
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=STOP_WAIT_S)
            if pending:
                log.warning("the Redis fan-out did not stop within %.1fs", STOP_WAIT_S)
        try:
            await asyncio.wait_for(self._redis.aclose(), STOP_WAIT_S)
        except (TimeoutError, RedisError, OSError) as exc:
            log.warning("closing the Redis client failed: %r", exc)

    async def _send_forever(self) -> None:
        while True:
            batch = [await self._outbox.get()]
            while not self._outbox.empty():
                batch.append(self._outbox.get_nowait())
            await self._send(batch)

    async def _send(self, batch: list[_Outgoing]) -> None:
        if not self.subscribed:  # our own streams would not hear it back
            for run, events, _ in batch:
                self._hub.publish(run, events)
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for _, _, message in batch:
                    pipe.publish(self._channel, message)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("publishing finalisations to Redis failed: %s", exc)
            if self.subscribed:
                for run, events, _ in batch:
                    self._hub.publish(run, events)

    async def _listen_forever(self) -> None:
        while True:
            try:
                await self._listen()
            except (RedisError, OSError) as exc:
                log.warning("the Redis subscription is lost (%s); retrying", exc)
            if self.subscribed:
                self._subscribed.clear()
                self._hub.degraded = True  # it hears only this replica until then
                self._hub.end_streams()  # they replay what they miss from the database
            await asyncio.sleep(RETRY_S)

    async def _listen(self) -> None:
        async with self._redis.pubsub(ignore_subscribe_messages=True) as pubsub:
            await pubsub.subscribe(self._channel)
            self._subscribed.set()
            self._hub.degraded = False
            # a stream opened while unsubscribed may have missed other replicas' events:
            # it replays them from the database (at start there is no stream yet)
            self._hub.end_streams()
            while True:
                message = await pubsub.get_message(timeout=POLL_S)
                if message is not None and message["type"] == "message":
                    self._deliver(message["data"])

    def _deliver(self, data: bytes) -> None:
        try:
            run, events = decode(data)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            log.warning("ignoring a malformed message on %s", self._channel)
            return
        self._hub.publish(run, events)
