"""RedisFanout against a redis-server of each test's own: only messages signed under the cluster's key (over their
channel and their sender) reach the hub, the others are counted by reason; a Redis that hangs (SIGSTOP) is an outage
(``available`` False, publishing still queued without blocking) until it answers again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from switchboard.control.cluster.fanout import RedisFanout, message_key, sign
from switchboard.control.hub import EventHub, Subscription
from switchboard.runtime.events import Event
from tests.e2e.cluster_support import RedisServer

SECRET = "cluster-secret-of-the-fanout-tests-0123456789"
DATABASE_URL = "postgresql+asyncpg://db.example:5432/cluster"  # names the channel; never connected to
WAIT_S = 30.0


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.send_signal(signal.SIGCONT)  # a stopped process would not act on SIGTERM
        server.stop()


@pytest.fixture
async def nodes(redis_server: RedisServer) -> AsyncIterator[tuple[RedisFanout, RedisFanout]]:
    """Two nodes' fan-outs on one Redis: node-a and node-b, each with a hub of its own."""
    fanouts = [
        RedisFanout(redis_server.url, EventHub(), node, database_url=DATABASE_URL, secret=SECRET)
        for node in ("node-a", "node-b")
    ]
    for fanout in fanouts:
        fanout.start()
    try:
        await _until(lambda: all(f.available for f in fanouts))
        yield fanouts[0], fanouts[1]
    finally:
        for fanout in fanouts:
            await fanout.aclose()


async def _until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT_S):
        while not check():
            await asyncio.sleep(0.01)


def _event(seq: int, text: str) -> Event:
    return Event(session_id="s1", seq=seq, type="user.input", data={"text": text}, cursor=seq)


def _body(event: Event, node: str = "node-a") -> dict[str, object]:
    return {"node": node, "cursor": event.cursor, "event": event.model_dump(mode="json")}


async def _texts(sub: Subscription, count: int) -> list[str]:
    out = []
    async with asyncio.timeout(WAIT_S):
        for _ in range(count):
            _, event, _ = await sub.get()
            out.append(event.data["text"])
    return out


async def test_only_messages_signed_with_the_cluster_key_reach_the_hub(
    redis_server: RedisServer, nodes: tuple[RedisFanout, RedisFanout]
):
    _, b = nodes
    sub = b._hub.subscribe()
    woken: list[bool] = []
    b.on_wake = lambda: woken.append(True)
    key = message_key(SECRET)
    forged = _event(1, "forged")
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        await client.publish(b.channel, json.dumps(_body(forged)))  # what anyone on Redis can send
        await client.publish(
            b.channel, sign(message_key("another-secret-0123456789-0123456789"), b.channel, _body(forged))
        )
        await client.publish(b.channel, sign(key, b.wake_channel, _body(forged)))  # signed for another channel
        body = _body(forged)
        signed = sign(key, b.channel, body)
        await client.publish(b.channel, signed.replace(b"forged", b"FORGED"))  # altered after signing
        await client.publish(b.wake_channel, b"node-x")  # the adopt wake-up: signed as well
        await client.publish(b.channel, sign(key, b.channel, {"node": "node-a", "cursor": 2, "event": {"seq": "x"}}))
        await client.publish(b.channel, sign(key, b.channel, _body(_event(2, "real"))))
        assert await _texts(sub, 1) == ["real"]  # delivered in order: everything before it was judged
        assert b.rejected == {"unsigned": 2, "bad_signature": 3, "malformed": 1}
        assert not woken
        await client.publish(b.wake_channel, sign(key, b.wake_channel, {"node": "node-a"}))
        await _until(lambda: bool(woken))
    finally:
        await client.aclose()
    assert sub.pending() == 0


async def test_what_one_node_publishes_reaches_the_other(nodes: tuple[RedisFanout, RedisFanout]):
    a, b = nodes
    sub = b._hub.subscribe()
    mine = a._hub.subscribe()
    a.on_durable([_event(1, "one"), _event(2, "two")])
    assert await _texts(sub, 2) == ["one", "two"]
    await asyncio.sleep(0.2)
    assert mine.pending() == 0  # a node's own events reach its hub from its store, not back from Redis
    assert b.rejected.total() == 0


async def test_a_frozen_redis_is_an_outage_until_it_answers_again(
    redis_server: RedisServer, nodes: tuple[RedisFanout, RedisFanout]
):
    """SIGSTOP: connections stay open and nothing answers. Both nodes find Redis unavailable (the subscription's
    PING goes unanswered, a publish does not return); a node still queues its events at once; once Redis runs
    again both find it available, and what was queued meanwhile is published."""
    a, b = nodes
    sub = b._hub.subscribe()
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        a.on_durable([_event(1, "while frozen")])  # queued, never awaited: the store's writer never waits on Redis
        await _until(lambda: not a.available and not b.available)
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    await _until(lambda: a.available and b.available)
    await _until(lambda: a.published == 1)  # the event queued meanwhile, published once Redis answered
    a.on_durable([_event(2, "after")])
    texts = await _texts(sub, 1)
    # the one queued during the freeze may come first (Redis may also run the attempt that timed out); or not at
    # all, if it went out before this node subscribed again: a stream reads it from the database
    while texts[-1] != "after":
        texts += await _texts(sub, 1)
    assert set(texts) <= {"while frozen", "after"}
    assert a.dropped == 0
