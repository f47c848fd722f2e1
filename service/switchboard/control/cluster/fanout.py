"""RedisFanout: in cluster mode, the durable events of this node's sessions reach the event streams of every node.

Redis carries them and never decides anything: an event is published only after it is durable, and a stream that
misses one (Redis down, a message lost) repairs the gap from the database (``control.cluster.feed``,
``control.cluster.session_order``). Each node publishes what its store made durable and hands what the others publish
to its own ``EventHub``.

Anyone who can PUBLISH on the cluster's Redis could otherwise show events on every node's streams, so every message
carries an HMAC under a key derived from the cluster secret, over the channel and the body (which names the sender):
a message without a valid one is dropped, counted by reason and logged once per sender and ``REJECT_LOG_S``. A signed
message is still only a hint: the feeds never move a stream past what the database holds.

A Redis that hangs (frozen, or a partition that drops packets without a reset) is an outage like a Redis that is
down: every call has a deadline, and the subscription, when it has heard nothing for ``QUIET_S``, sends a PING and
reconnects unless the answer comes within ``CALL_TIMEOUT_S``. Meanwhile ``available`` is False and the cluster feed
reads the other nodes' events from the database.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from sqlalchemy.engine import make_url

from ...runtime.aio import cancel_and_wait
from ...runtime.events import Event
from ..hub import EventHub
from .shared_buckets import REDIS_ERRORS

logger = logging.getLogger("switchboard.control.cluster.fanout")

CHANNEL_PREFIX = "switchboard:events:"  # + the database: clusters sharing one Redis do not see each other's events
QUEUE_MAX = 10_000  # events waiting to be published; past it they are dropped (streams repair from the database)
RETRY_MIN_S = 0.1
RETRY_MAX_S = 2.0
CALL_TIMEOUT_S = 1.0  # every call to Redis (connect, publish, subscribe, a PING's answer)
QUIET_S = 1.0  # a subscription that heard nothing for this long proves it is alive (PING)
REJECT_LOG_S = 60.0  # a rejected message is logged once per (reason, claimed sender) in this time
REJECT_LOG_KEYS = 64  # at most this many such lines per REJECT_LOG_S, whatever senders a forger claims
REJECT_REASONS = ("unsigned", "bad_signature", "malformed")
MAC_CHARS = 43  # an HMAC-SHA256 in unpadded base64url


def message_key(secret: str) -> bytes:
    """The key that signs the cluster's Redis messages: its own, so a message MAC is never a token or a forward."""
    return hmac.new(secret.encode(), b"switchboard cluster messages v1", hashlib.sha256).digest()


def _mac(key: bytes, channel: str, body: bytes) -> bytes:
    digest = hmac.new(key, channel.encode() + b"\n" + body, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=")


def sign(key: bytes, channel: str, body: dict[str, Any]) -> bytes:
    """A message for ``channel``: ``<MAC>.<JSON body>``; the body names its sender (``node``)."""
    raw = json.dumps(body, separators=(",", ":")).encode()
    return _mac(key, channel, raw) + b"." + raw


class RedisFanout:
    def __init__(self, url: str, hub: EventHub, node_id: str, *, database_url: str, secret: str) -> None:
        # one attempt per call, each bounded: the loops below retry, and a hang must surface as an error
        self._redis: aioredis.Redis = aioredis.Redis.from_url(
            url, socket_timeout=CALL_TIMEOUT_S, socket_connect_timeout=CALL_TIMEOUT_S, retry=Retry(NoBackoff(), 0)
        )
        db = make_url(database_url)
        self.channel = f"{CHANNEL_PREFIX}{db.host}:{db.port or 5432}/{db.database}"
        self.wake_channel = f"{self.channel}:adopt"  # a draining node handed sessions over: adopt them now
        self.on_wake: Callable[[], None] | None = None
        self._key = message_key(secret)
        self._hub = hub
        self._node_id = node_id
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=QUEUE_MAX)
        self._tasks: list[asyncio.Task[None]] = []
        self._listening = False  # the subscription is proven alive (it heard something within its deadline)
        self._publishing = True  # the last publish reached Redis (a node with nothing to publish is not in outage)
        self.published = 0
        self.received = 0
        self.dropped = 0
        self.rejected: collections.Counter[str] = collections.Counter()
        self._rejects_logged: dict[tuple[str, str], float] = {}

    @property
    def available(self) -> bool:
        """Redis carries events both ways: the subscription answers and publishing works."""
        return self._listening and self._publishing

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._publish_forever(), name="fanout-publish"),
            asyncio.create_task(self._receive_forever(), name="fanout-receive"),
        ]

    async def aclose(self) -> None:
        await cancel_and_wait(*self._tasks)
        await self._redis.aclose()  # each connection's close is bounded by the connect timeout

    def on_durable(self, events: list[Event]) -> None:
        """Queue this node's durable events for the others (never blocks the store's writer)."""
        for event in events:
            body = {"node": self._node_id, "cursor": event.cursor or 0, "event": event.model_dump(mode="json")}
            try:
                self._queue.put_nowait(sign(self._key, self.channel, body))
            except asyncio.QueueFull:
                self.dropped += 1

    async def wake_adopters(self) -> None:
        """Tell the other nodes that sessions wait for them (best effort: without Redis they look on their own)."""
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                await self._redis.publish(
                    self.wake_channel, sign(self._key, self.wake_channel, {"node": self._node_id})
                )
        except REDIS_ERRORS as err:
            logger.warning("fan-out: cannot wake the other nodes through Redis (%r); they look on their own", err)

    async def _publish_forever(self) -> None:
        delay = RETRY_MIN_S
        while True:
            message = await self._queue.get()
            while True:
                try:
                    async with asyncio.timeout(CALL_TIMEOUT_S):
                        await self._redis.publish(self.channel, message)
                except REDIS_ERRORS as err:
                    self._set(publishing=False, err=err)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX_S)
                    if self._queue.full():  # the outage outlasts the queue: this one is lost to live streams
                        self.dropped += 1
                        break
                    continue
                self._set(publishing=True)
                delay = RETRY_MIN_S
                self.published += 1
                break

    async def _receive_forever(self) -> None:
        delay = RETRY_MIN_S
        while True:
            try:
                async with self._redis.pubsub() as pubsub:
                    async with asyncio.timeout(CALL_TIMEOUT_S):
                        await pubsub.subscribe(self.channel, self.wake_channel)
                    await self._listen(pubsub)
            except REDIS_ERRORS as err:
                delay = RETRY_MIN_S if self._listening else min(delay * 2, RETRY_MAX_S)
                self._set(listening=False, err=err)
                await asyncio.sleep(delay)

    async def _listen(self, pubsub: PubSub) -> None:
        """Hand on what the subscription hears. Once it has heard nothing for ``QUIET_S`` it sends a PING; with no
        answer ``CALL_TIMEOUT_S`` later it raises ``TimeoutError`` (the caller reconnects)."""
        loop = asyncio.get_running_loop()
        heard_at = loop.time()
        pinged = False
        while True:
            quiet = loop.time() - heard_at
            if quiet >= QUIET_S and not pinged:
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    await pubsub.ping()
                pinged = True
            wait_s = QUIET_S + (CALL_TIMEOUT_S if pinged else 0.0) - quiet
            if wait_s <= 0:
                raise TimeoutError(f"Redis did not answer a PING within {CALL_TIMEOUT_S} s")
            async with asyncio.timeout(wait_s + CALL_TIMEOUT_S):  # the read ends at wait_s; this is a backstop
                message = await pubsub.get_message(timeout=wait_s)
            if message is None:
                continue
            heard_at, pinged = loop.time(), False
            self._set(listening=True)  # its subscribe confirmation first, then messages and PING answers
            if message.get("type") == "message":
                self._heard(message["channel"], message["data"])

    def _heard(self, channel: bytes | str, raw: bytes | str) -> None:
        name = channel.decode() if isinstance(channel, bytes) else channel
        data = self._open(name, raw.encode() if isinstance(raw, str) else raw)
        if data is None or data["node"] == self._node_id:
            return  # this node's own events reached its hub from its store
        if name == self.wake_channel:
            if self.on_wake is not None:
                self.on_wake()
            return
        try:
            cursor, event = data["cursor"], Event.model_validate(data["event"])
            if not isinstance(cursor, int) or cursor < 0:
                raise ValueError(f"cursor {cursor!r}")
        except (ValueError, KeyError, TypeError) as err:  # a pydantic ValidationError is a ValueError
            self._reject("malformed", data["node"], repr(err))
            return
        self.received += 1
        self._hub.publish([(cursor, event)])

    def _open(self, channel: str, raw: bytes) -> dict[str, Any] | None:
        """The body of an authentic message of this cluster, or None (the message is counted and dropped)."""
        mac, dot, body = raw.partition(b".")
        if not dot or len(mac) != MAC_CHARS:
            self._reject("unsigned", _claimed_sender(raw))
            return None
        if not hmac.compare_digest(mac, _mac(self._key, channel, body)):
            self._reject("bad_signature", _claimed_sender(body))
            return None
        try:
            data = json.loads(body)
            if not isinstance(data, dict) or not isinstance(data.get("node"), str):
                raise ValueError("no sender")
        except ValueError as err:
            self._reject("malformed", "?", repr(err))
            return None
        return data

    def _reject(self, reason: str, sender: str, detail: str = "") -> None:
        self.rejected[reason] += 1
        now = time.monotonic()
        logged, key = self._rejects_logged, (reason, sender)
        last = logged.get(key)
        if last is not None and now - last < REJECT_LOG_S:
            return
        if last is None and len(logged) >= REJECT_LOG_KEYS:
            for old in [k for k, at in logged.items() if now - at >= REJECT_LOG_S]:
                del logged[old]
            if len(logged) >= REJECT_LOG_KEYS:
                return  # a flood of claimed senders: counted, not logged
        logged[key] = now
        logger.warning(
            "fan-out: dropped a Redis message (%s) claiming to come from %s%s; more like it are counted in "
            "switchboard_cluster_messages_rejected and logged again after %.0f s",
            reason,
            sender,
            f": {detail}" if detail else "",
            REJECT_LOG_S,
        )

    def _set(
        self, *, listening: bool | None = None, publishing: bool | None = None, err: BaseException | None = None
    ) -> None:
        was = self.available
        if listening is not None:
            self._listening = listening
        if publishing is not None:
            self._publishing = publishing
        if was and not self.available:
            logger.warning(
                "fan-out: Redis unavailable (%r); event streams read other nodes' events from the database", err
            )
        elif self.available and not was:
            logger.info("fan-out: Redis available; events between nodes go through it again")


def _claimed_sender(raw: bytes) -> str:
    """Who an unauthenticated message says it is from, for the log line (a claim, never trusted)."""
    try:
        node = json.loads(raw).get("node")
    except (ValueError, AttributeError):
        return "(unknown)"
    return repr(node[:100]) if isinstance(node, str) else "(unknown)"
