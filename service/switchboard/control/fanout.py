"""RedisFanout: in cluster mode, the durable events of this node's sessions reach the event streams of every node.

Redis carries them and never decides anything: an event is published only after it is durable, and a stream that
misses one (Redis down, a message lost) repairs the gap from the database when the next event shows it
(``routes_events``). Each node publishes what its store made durable and hands what the others publish to its own
``EventHub``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from sqlalchemy.engine import make_url

from ..runtime.aio import cancel_and_wait
from ..runtime.events import Event
from .hub import EventHub

logger = logging.getLogger("switchboard.control.fanout")

CHANNEL_PREFIX = "switchboard:events:"  # + the database: clusters sharing one Redis do not see each other's events
QUEUE_MAX = 10_000  # events waiting to be published; past it they are dropped (streams repair from the database)
RETRY_MIN_S = 0.1
RETRY_MAX_S = 2.0
WAKE_TIMEOUT_S = 1.0


class RedisFanout:
    def __init__(self, url: str, hub: EventHub, node_id: str, *, database_url: str) -> None:
        self._redis: aioredis.Redis = aioredis.Redis.from_url(url)
        db = make_url(database_url)
        self.channel = f"{CHANNEL_PREFIX}{db.host}:{db.port or 5432}/{db.database}"
        self.wake_channel = f"{self.channel}:adopt"  # a draining node handed sessions over: adopt them now
        self.on_wake: Callable[[], None] | None = None
        self._hub = hub
        self._node_id = node_id
        self._queue: asyncio.Queue[str] = asyncio.Queue(maxsize=QUEUE_MAX)
        self._tasks: list[asyncio.Task[None]] = []
        self.available = False  # the last publish or subscribe reached Redis
        self.published = 0
        self.received = 0
        self.dropped = 0

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._publish_forever(), name="fanout-publish"),
            asyncio.create_task(self._receive_forever(), name="fanout-receive"),
        ]

    async def aclose(self) -> None:
        await cancel_and_wait(*self._tasks)
        await self._redis.aclose()

    def on_durable(self, events: list[Event]) -> None:
        """Queue this node's durable events for the others (never blocks the store's writer)."""
        for event in events:
            message = json.dumps(
                {"node": self._node_id, "cursor": event.cursor or 0, "event": event.model_dump(mode="json")}
            )
            try:
                self._queue.put_nowait(message)
            except asyncio.QueueFull:
                self.dropped += 1

    async def wake_adopters(self) -> None:
        """Tell the other nodes that sessions wait for them (best effort: without Redis they look on their own)."""
        try:
            async with asyncio.timeout(WAKE_TIMEOUT_S):
                await self._redis.publish(self.wake_channel, self._node_id)
        except (aioredis.RedisError, OSError, TimeoutError) as err:
            self._down(err)

    async def _publish_forever(self) -> None:
        delay = RETRY_MIN_S
        while True:
            message = await self._queue.get()
            while True:
                try:
                    await self._redis.publish(self.channel, message)
                except (aioredis.RedisError, OSError) as err:
                    self._down(err)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX_S)
                    if self._queue.full():  # the outage outlasts the queue: this one is lost to live streams
                        self.dropped += 1
                        break
                    continue
                self.available, delay = True, RETRY_MIN_S
                self.published += 1
                break

    async def _receive_forever(self) -> None:
        delay = RETRY_MIN_S
        while True:
            try:
                async with self._redis.pubsub() as pubsub:
                    await pubsub.subscribe(self.channel, self.wake_channel)
                    self.available, delay = True, RETRY_MIN_S
                    async for message in pubsub.listen():
                        if message.get("type") != "message":
                            continue
                        if message.get("channel") in (self.wake_channel, self.wake_channel.encode()):
                            self._woken(message["data"])
                        else:
                            self._deliver(message["data"])
            except (aioredis.RedisError, OSError) as err:
                self._down(err)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)

    def _woken(self, raw: Any) -> None:
        sender = raw.decode() if isinstance(raw, bytes) else str(raw)
        if sender != self._node_id and self.on_wake is not None:
            self.on_wake()

    def _deliver(self, raw: Any) -> None:
        try:
            data = json.loads(raw)
            if data.get("node") == self._node_id:
                return  # this node's own events reached its hub from its store
            event = Event.model_validate(data["event"])
        except (ValueError, KeyError, TypeError) as err:
            logger.warning("fan-out: ignoring a malformed message (%r)", err)
            return
        self.received += 1
        self._hub.publish([(int(data.get("cursor") or 0), event)])

    def _down(self, err: BaseException) -> None:
        if self.available:
            logger.warning("fan-out: Redis unavailable (%r); event streams catch up from the database", err)
        self.available = False
