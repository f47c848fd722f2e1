"""Redis decides nothing, with real nodes and a redis-server of the test's own: a Redis that hangs (SIGSTOP) is reported
as an outage and the streams of another node go on from the database; a message anyone can PUBLISH on the cluster's
Redis (unsigned, signed with another key, or signed but announcing a cursor the database never reaches) shows on no
stream and stops none; and a session token minted on one node works on another (every node has the token secret)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
import websockets
from sqlalchemy.engine import make_url

from switchboard.control.cluster.fanout import CHANNEL_PREFIX, message_key, sign
from switchboard.runtime.events import Event
from tests.waiting import WAIT_S

from .cluster_support import (
    FORWARDED,
    SECRET,
    RedisServer,
    ResumingStream,
    assert_gap_free,
    cluster_node,
    start_all,
    until,
)
from .server import EventStream, Server

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.timeout(240)]

FORGED = "FORGED"
KEY = "cluster-redis-key-0123456789"
KEYS = json.dumps([{"key": KEY, "scopes": ["sessions:read", "sessions:write", "sessions:control", "events:read"]}])


def _nodes(tmp_path: Path, database_url: str, redis: RedisServer, **env: str) -> list[Server]:
    return [
        cluster_node(tmp_path, database_url, f"node-{x}", redis.url, SWITCHBOARD_CLUSTER_SECRET=SECRET, **env)
        for x in "ab"
    ]


async def _pinned(http: httpx.AsyncClient, node: Server, node_id: str, **headers: str) -> str:
    """A session run by ``node`` (a request forwarded by a node is placed where it arrives)."""
    llm = {"provider": "scripted", "turns": [], "fallback": {"text": "Noted."}}
    body = {"agent": "tester", "llm": llm}
    r = await http.post(f"{node.url}/v1/sessions", json=body, headers={FORWARDED: SECRET, **headers})
    assert r.status_code == 201, r.text
    assert r.json()["owner_node"] == node_id
    return str(r.json()["id"])


async def _say(http: httpx.AsyncClient, node: Server, sid: str, text: str, **headers: str) -> None:
    r = await http.post(f"{node.url}/v1/sessions/{sid}/input", json={"text": text}, headers=headers)
    assert r.status_code == 202, r.text


async def _metric(http: httpx.AsyncClient, node: Server, name: str) -> float | None:
    """A sample of /metrics, by its name with its labels (``name{label="value"}``)."""
    for line in (await http.get(f"{node.url}/metrics")).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return None


async def _redis_reported(http: httpx.AsyncClient, nodes: list[Server], *, up: bool) -> bool:
    """What every node says of Redis: the metrics, and /readyz (200 either way; degraded while Redis is away)."""
    for node in nodes:
        ready = await http.get(f"{node.url}/readyz")
        degraded = "redis unavailable" in str(ready.json().get("detail"))
        polling = await _metric(http, node, 'switchboard_cluster_fanout_mode{mode="database_polling"}')
        if ready.status_code != 200 or degraded == up or polling != (0.0 if up else 1.0):
            return False
        if await _metric(http, node, "switchboard_cluster_redis_up") != (1.0 if up else 0.0):
            return False
    return True


def _answered(frames: list[dict[str, Any]], sid: str, text: str) -> bool:
    """The input ``text``, the reply to it and the session listening again (its last event until the next input)."""
    mine = [f for f in frames if f["session_id"] == sid]
    at = next((n for n, f in enumerate(mine) if f["type"] == "user.input" and f["data"]["text"] == text), None)
    done = (
        next((n for n, f in enumerate(mine[at:], at) if f["type"] == "speech.done"), None) if at is not None else None
    )
    return done is not None and any(
        f["type"] == "agent.state" and f["data"]["state"] == "listening" for f in mine[done:]
    )


async def test_a_frozen_redis_is_an_outage_and_streams_go_on_from_the_database(
    tmp_path: Path, database_url: str, redis: RedisServer
):
    """SIGSTOP on Redis: its connections stay open and nothing answers. Each node finds it unavailable (the metrics,
    /readyz 200 with a detail naming Redis), a session on node-a keeps answering, and streams on node-b get its events
    from the database; after SIGCONT both say Redis is back and events flow through it again."""
    nodes = _nodes(tmp_path, database_url, redis)
    a, b = nodes
    streams: list[ResumingStream] = []
    assert redis.proc is not None
    try:
        await start_all(nodes)
        async with httpx.AsyncClient(timeout=30) as http:
            await until(lambda: _redis_reported(http, nodes, up=True))
            sid = await _pinned(http, a, "node-a")
            remote = ResumingStream.session(nodes, sid, first=b)
            multi = ResumingStream.multi(nodes, first=b)
            streams += [remote, multi]
            await until(lambda: _connected(streams))
            await _say(http, a, sid, "before")
            for stream in streams:
                await stream.wait_for(lambda fr: _answered(fr, sid, "before"))

            os.kill(redis.proc.pid, signal.SIGSTOP)
            try:
                await until(lambda: _redis_reported(http, nodes, up=False))
                await _say(http, a, sid, "while frozen")  # commands never need Redis
                for stream in streams:
                    await stream.wait_for(lambda fr: _answered(fr, sid, "while frozen"))
            finally:
                os.kill(redis.proc.pid, signal.SIGCONT)
            await until(lambda: _redis_reported(http, nodes, up=True))
            await _say(http, a, sid, "after")
            for stream in streams:
                await stream.wait_for(lambda fr: _answered(fr, sid, "after"))
        assert remote.connections == [b.url] and multi.connections == [b.url]  # never cut: no resume needed
        assert_gap_free(remote.frames, [sid])
        assert_gap_free(multi.frames, [sid])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(redis.proc.pid, signal.SIGCONT)
        for stream in streams:
            await stream.aclose()
        for node in nodes:
            node.kill()


async def test_messages_forged_on_redis_reach_no_stream_and_stop_none(
    tmp_path: Path, database_url: str, redis: RedisServer
):
    """Anyone who can PUBLISH on the cluster's Redis sends the next event of a live session (unsigned, then signed
    with another key) and an event signed with the cluster's key under a cursor far beyond the database's: no stream
    on either node (the owner's too) shows any of them, each node counts them, and the real events that follow reach
    every stream, the multi-session streams included."""
    nodes = _nodes(tmp_path, database_url, redis)
    a, b = nodes
    streams: list[ResumingStream] = []
    client = aioredis.Redis.from_url(redis.url)
    try:
        await start_all(nodes)
        async with httpx.AsyncClient(timeout=30) as http:
            sid = await _pinned(http, a, "node-a")
            streams = [
                ResumingStream.session(nodes, sid, first=a),
                ResumingStream.session(nodes, sid, first=b),
                ResumingStream.multi(nodes, first=a),
                ResumingStream.multi(nodes, first=b),
            ]
            await until(lambda: _connected(streams))
            await _say(http, a, sid, "before")
            for stream in streams:
                await stream.wait_for(lambda fr: _answered(fr, sid, "before"))
            last = streams[0].frames[-1]["seq"]
            cursor = streams[2].frames[-1]["cursor"]

            channel = _channel(database_url)
            nxt = Event(session_id=sid, seq=last + 1, type="user.input", data={"text": FORGED, "final": True})
            body = {"node": "node-x", "cursor": cursor + 1, "event": nxt.model_dump(mode="json")}
            await client.publish(channel, json.dumps(body))
            await client.publish(channel, sign(message_key("not-the-cluster-secret-0123456789"), channel, body))
            ghost = Event(session_id="ghost", seq=1, type="user.input", data={"text": FORGED, "final": True})
            far = {"node": "node-x", "cursor": 10**15, "event": ghost.model_dump(mode="json")}
            await client.publish(channel, sign(message_key(SECRET), channel, far))

            for node in nodes:
                await until(lambda node=node: _judged(http, node))
            await _say(http, a, sid, "after")
            for stream in streams:
                await stream.wait_for(lambda fr: _answered(fr, sid, "after"))
        for stream in streams:
            assert not [f for f in stream.frames if FORGED in json.dumps(f)]
            assert stream.connections in ([a.url], [b.url])  # never cut: no resume needed
            assert_gap_free(stream.frames, [sid])
        for multi in streams[2:]:
            assert all(f["cursor"] < 10**15 for f in multi.frames)
    finally:
        await client.aclose()
        for stream in streams:
            await stream.aclose()
        for node in nodes:
            node.kill()


async def test_a_session_token_minted_on_one_node_reads_and_streams_the_session_on_another(
    tmp_path: Path, database_url: str, redis: RedisServer
):
    """Every node is started with the same SWITCHBOARD_TOKEN_SECRET (cluster mode does not start without it), so a
    token a dashboard got from node-a works on node-b, where a load balancer may send it."""
    refused = cluster_node(tmp_path, database_url, "node-c", redis.url, SWITCHBOARD_TOKEN_SECRET="")
    assert refused.launch().wait(60) == 2
    assert "cluster mode needs SWITCHBOARD_TOKEN_SECRET" in refused.logs()

    nodes = _nodes(tmp_path, database_url, redis, SWITCHBOARD_API_KEYS=KEYS)
    a, b = nodes
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        await start_all(nodes)
        async with httpx.AsyncClient(timeout=30) as http:
            sid = await _pinned(http, a, "node-a", **auth)
            r = await http.post(f"{a.url}/v1/sessions/{sid}/tokens", json={"ttl_s": 600}, headers=auth)
            assert r.status_code == 201, r.text
            token = r.json()["token"]
            r = await http.get(f"{b.url}/v1/sessions/{sid}", headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200, r.text
            assert r.json()["id"] == sid
            ws = await websockets.connect(f"{b.ws_url}/v1/sessions/{sid}/events?since=0&token={token}")
            stream = EventStream(ws)
            try:
                await stream.wait_for("session.started", timeout=WAIT_S)
                await _say(http, a, sid, "hello", **auth)
                await stream.wait_for("speech.done", timeout=WAIT_S)
            finally:
                await ws.close()
    finally:
        for node in nodes:
            node.kill()


def _channel(database_url: str) -> str:
    """The cluster's event channel on Redis (named after its database)."""
    db = make_url(database_url)
    return f"{CHANNEL_PREFIX}{db.host}:{db.port or 5432}/{db.database}"


async def _judged(http: httpx.AsyncClient, node: Server) -> bool:
    """``node`` dropped the two messages that failed their signature and, once it read the database, the third."""
    rejected = "switchboard_cluster_messages_rejected_total"
    return (
        await _metric(http, node, f'{rejected}{{reason="unsigned"}}') == 1
        and await _metric(http, node, f'{rejected}{{reason="bad_signature"}}') == 1
        and await _metric(http, node, 'switchboard_cluster_events_discarded_total{feed="cursor"}') == 1
    )


async def _connected(streams: list[ResumingStream]) -> bool:
    return all(stream.connections for stream in streams)
