"""Media edges in cluster mode, with three real nodes: an edge that reaches a node that does not run its session is
relayed to the one that does (frames both ways, closes unchanged), after its credential was checked where it
arrived; the owner takes a relayed connection only with the cluster secret; an owner killed under a relayed edge
closes it with 4410, and the edge connects again, to any node, once the session is adopted."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from .cluster_support import (
    FORWARDED,
    LEASE_S,
    SECRET,
    RedisServer,
    cluster_node,
    drain_stop,
    start_all,
    until,
    up,
)
from .edge_client import Edge
from .server import EventStream, Server

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.timeout(240)]

KEY = "cluster-media-key-0123456789"
NO_MEDIA_KEY = "cluster-no-media-key-0123456789"
SCOPES = ["sessions:read", "sessions:write", "sessions:control", "events:read", "metrics:read"]
KEYS = json.dumps([{"key": KEY, "scopes": [*SCOPES, "media:connect"]}, {"key": NO_MEDIA_KEY, "scopes": SCOPES}])
AUTH = {"Authorization": f"Bearer {KEY}"}
WORDS = " ".join(f"word{i}" for i in range(40))
WAIT_S = 30.0


def _nodes(tmp_path: Path, db_url: str, redis_server: RedisServer) -> list[Server]:
    env = {"SWITCHBOARD_CLUSTER_SECRET": SECRET, "SWITCHBOARD_API_KEYS": KEYS}
    return [cluster_node(tmp_path, db_url, f"node-{x}", redis_server.url, **env) for x in "abc"]


async def _pinned(http: httpx.AsyncClient, node: Server, node_id: str, turns: list[dict[str, Any]]) -> str:
    """A session run by ``node`` (a request forwarded by a node is placed where it arrives)."""
    llm = {"provider": "scripted", "turns": turns, "fallback": {"text": "Noted."}}
    r = await http.post(f"{node.url}/v1/sessions", json={"agent": "tester", "llm": llm}, headers={FORWARDED: SECRET})
    assert r.status_code == 201, r.text
    assert r.json()["owner_node"] == node_id
    return str(r.json()["id"])


async def _metrics(http: httpx.AsyncClient, node: Server, name: str) -> dict[str, float]:
    """The samples of ``name`` on ``node``, by their labels as written (`` `` for none)."""
    text = (await http.get(f"{node.url}/metrics")).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name):
            sample, value = line.rsplit(" ", 1)
            found[sample[len(name) :]] = float(value)
    return found


async def _pong(edge: Edge) -> None:
    await edge.send({"type": "ping"})
    await edge.wait_for("pong", timeout=WAIT_S)


async def test_an_edge_on_any_node_plays_its_sessions_speeches_through_the_owner(
    tmp_path: Path,
    database_url: str,
    redis: RedisServer,
) -> None:
    """The edge reaches node-b, the session runs on node-a: speeches arrive, playback reports and a barge-in reach the
    session (the heard text is what the edge reported), an edge that leaves leaves the owner too, and the owner's
    closes (4409 when an edge through node-c replaces it, 1000 when the session ends) reach the edge unchanged. A bad
    credential is refused by node-b without a connection to the owner; the owner refuses a relayed connection without
    the cluster secret."""
    nodes = _nodes(tmp_path, database_url, redis)
    a, b, c = nodes
    try:
        await start_all(nodes)
        async with httpx.AsyncClient(timeout=30, headers=AUTH) as http:
            sid = await _pinned(http, a, "node-a", [{"text": WORDS}, {"text": "Hello there."}])

            for refused, headers in ((4401, {}), (4403, {"Authorization": f"Bearer {NO_MEDIA_KEY}"})):
                edge = await Edge.connect(b.ws_url, sid, additional_headers=headers)
                assert (await edge.wait_closed())[0] == refused
            assert await _metrics(http, b, "switchboard_node_media_relays_total") == {}  # never sent on
            for wrong in ("", "not-the-secret-" * 3):  # straight to the owner, claiming to be relayed
                edge = await Edge.connect(a.ws_url, sid, additional_headers={**AUTH, FORWARDED: wrong})
                assert await edge.wait_closed() == (4403, "forward_unauthenticated")
            # with the secret, the owner still checks the edge's own credential
            edge = await Edge.connect(a.ws_url, sid, additional_headers={FORWARDED: SECRET})
            assert (await edge.wait_closed())[0] == 4401

            events = await EventStream.open(a, sid, types="speech.*", additional_headers=AUTH)
            edge = await Edge.connect(b.ws_url, sid, additional_headers=AUTH)
            await _pong(edge)
            assert await _metrics(http, a, "switchboard_media_edges") == {"": 1.0}
            await edge.send({"type": "user.transcript", "text": "talk to me"})
            start = await edge.wait_for("speech.start", timeout=WAIT_S)
            speech_id = start["speech_id"]
            await edge.send({"type": "playback.started", "speech_id": speech_id})
            text = await edge.wait_text(speech_id, len(WORDS), timeout=WAIT_S)
            heard = text.index("word7") + len("word7")
            await edge.send({"type": "playback.progress", "speech_id": speech_id, "played_chars": heard})
            await edge.send({"type": "user.speech_started"})  # barge-in
            await edge.wait_for("speech.stop", lambda f: f["speech_id"] == speech_id, timeout=WAIT_S)
            interrupted = await events.wait_for(
                "speech.interrupted", lambda d: d["speech_id"] == speech_id, timeout=WAIT_S
            )
            assert interrupted["data"]["played_text"] == text[:heard]

            await edge.send({"type": "user.transcript", "text": "again"})
            second = await edge.wait_for("speech.end", lambda f: f["speech_id"] != speech_id, timeout=WAIT_S)
            assert edge.texts[second["speech_id"]] == "Hello there."
            await edge.send({"type": "playback.progress", "speech_id": second["speech_id"], "played_chars": 12})
            await edge.send({"type": "playback.finished", "speech_id": second["speech_id"], "interrupted": False})
            done = await events.wait_for("speech.done", lambda d: d["speech_id"] == second["speech_id"], timeout=WAIT_S)
            assert done["data"]["interrupted"] is False
            assert edge.of_type("error") == []
            order = [f["type"] for f in edge.frames if f.get("speech_id") == second["speech_id"]]
            assert order[0] == "speech.start" and order[-1] == "speech.end", order

            other = await Edge.connect(c.ws_url, sid, additional_headers=AUTH)  # relayed too: replaces the first
            await _pong(other)
            assert (await edge.wait_closed())[0] == 4409
            await other.close()  # the edge leaves: the owner sees it leave
            await until(lambda: _edges(http, a, 0))
            last = await Edge.connect(b.ws_url, sid, additional_headers=AUTH)
            await _pong(last)
            assert (await http.delete(f"{c.url}/v1/sessions/{sid}")).status_code == 204
            assert (await last.wait_closed())[0] == 1000
            relays = [await _metrics(http, n, "switchboard_node_media_relays_total") for n in (b, c)]
            assert relays == [{'{outcome="connected"}': 2.0}, {'{outcome="connected"}': 1.0}]
            await until(lambda: _no_relays(http, [b, c]))
            await events.close()
    finally:
        for node in nodes:
            node.kill()


async def _edges(http: httpx.AsyncClient, node: Server, count: int) -> bool:
    return await _metrics(http, node, "switchboard_media_edges") == {"": float(count)}


async def _no_relays(http: httpx.AsyncClient, nodes: list[Server]) -> bool:
    gauges = [await _metrics(http, n, "switchboard_node_media_relays_open") for n in nodes]
    return all(g == {"": 0.0} for g in gauges)


async def test_an_owner_killed_under_a_relayed_edge_closes_it_to_reconnect_anywhere(
    tmp_path: Path,
    database_url: str,
    redis: RedisServer,
) -> None:
    """SIGKILL the owner while an edge relayed through node-b plays a speech: the edge is closed with 4410 at once
    (not left hanging on a dead node); connecting again to any node is answered 4410 (or 1013) until the session is
    adopted, then the edge plays the session's next speech from its new node."""
    nodes = _nodes(tmp_path, database_url, redis)
    a, b, _ = nodes
    try:
        await start_all(nodes)
        async with httpx.AsyncClient(timeout=30, headers=AUTH) as http:
            sid = await _pinned(http, a, "node-a", [{"text": WORDS}, {"text": "Back again."}])
            edge = await Edge.connect(b.ws_url, sid, additional_headers=AUTH)
            await edge.send({"type": "user.transcript", "text": "talk to me"})
            start = await edge.wait_for("speech.start", timeout=WAIT_S)
            await edge.send({"type": "playback.started", "speech_id": start["speech_id"]})
            await edge.wait_text(start["speech_id"], 10, timeout=WAIT_S)

            a.kill()
            code, reason = await edge.wait_closed(timeout=WAIT_S)
            assert code == 4410 and "node-a" in reason, (code, reason)
            assert (await _metrics(http, b, "switchboard_node_media_relays_total"))['{outcome="lost"}'] == 1.0

            refusals: list[int] = []
            edge = await until(lambda: _served(nodes, sid, refusals), timeout_s=LEASE_S + 40, every_s=0.3)
            # 4410 until adopted; 1013 (the node's database did not answer in time, on a loaded machine) says
            # "connect again in a moment" too: both are refusals an edge retries, never a final close
            assert set(refusals) <= {4410, 1013}, refusals
            await edge.send({"type": "user.transcript", "text": "are you there?"})
            await edge.wait_for("speech.start", timeout=WAIT_S)
            r = await http.get(f"{b.url}/v1/sessions/{sid}")
            assert r.json()["owner_node"] in ("node-b", "node-c"), r.text
            await edge.close()
    finally:
        for node in nodes:
            node.kill()


async def _served(nodes: list[Server], sid: str, refusals: list[int]) -> Edge | None:
    """An edge on a random live node that answers a ping (the session runs somewhere again), or None."""
    node = random.choice(up(nodes))
    try:
        edge = await Edge.connect(node.ws_url, sid, additional_headers=AUTH, open_timeout=10)
        await edge.send({"type": "ping"})
    except (OSError, websockets.WebSocketException, TimeoutError):
        return None
    try:
        await edge.wait_for("pong", timeout=WAIT_S)
    except AssertionError:  # closed instead
        refusals.append((await edge.wait_closed())[0])
        return None
    return edge


async def test_an_edge_resuming_after_a_drain_on_another_node_starts_fresh_with_the_owed_speech(
    tmp_path: Path,
    database_url: str,
    redis: RedisServer,
) -> None:
    """A drain moves the session while an edge that resumes plays its speech: the edge is closed (4410 or 1012), and its
    resume where the session runs next is refused (positions are the node's own); it starts fresh there, its stream
    numbered from 1, and the speech under way is owed and played again there under its own id."""
    nodes = _nodes(tmp_path, database_url, redis)[:2]
    a, b = nodes
    try:
        await start_all(nodes)
        async with httpx.AsyncClient(timeout=30, headers=AUTH) as http:
            sid = await _pinned(http, a, "node-a", [{"text": WORDS, "word_ms": 100}, {"text": "The rest."}])
            query = {"edge_id": "drained-edge", "connection": 1, "resume": 0}
            edge = await Edge.connect(a.ws_url, sid, additional_headers=AUTH, query=query)
            await edge.send({"type": "user.transcript", "text": "talk to me"})
            start = await edge.wait_for("speech.start", timeout=WAIT_S)
            speech_id = start["speech_id"]
            await edge.send({"type": "playback.started", "speech_id": speech_id})
            await edge.wait_text(speech_id, 10, timeout=WAIT_S)
            consumed = max(f["n"] for f in edge.frames if f.get("n") is not None)

            await asyncio.to_thread(drain_stop, a)  # SIGTERM: node-a hands the session over and exits
            code, _ = await edge.wait_closed(timeout=WAIT_S)
            # the session's 4410, or uvicorn's 1012 when the stopping node closes its connections first: both say
            # "connect again"
            assert code in (4410, 1012), code

            numbers = itertools.count(2)

            async def resumed_on_b() -> Edge | None:
                query = {"edge_id": "drained-edge", "connection": next(numbers), "resume": consumed}
                again = await Edge.connect(b.ws_url, sid, additional_headers=AUTH, query=query)
                try:
                    await again.wait_for("resume.refused", timeout=WAIT_S)
                except AssertionError:  # closed: not adopted yet
                    return None
                return again

            again = await until(resumed_on_b, timeout_s=LEASE_S + 40, every_s=0.3)

            async def owed_played() -> bool:  # on b: sent to the edge, or played before it connected
                if any(f["type"] == "speech.start" and f["speech_id"] == speech_id for f in again.frames):
                    return True
                r = await http.get(f"{b.url}/v1/sessions/{sid}/speeches/{speech_id}")
                return r.status_code == 200 and r.json()["state"] == "done"

            await until(owed_played, timeout_s=WAIT_S)
            await again.send({"type": "user.transcript", "text": "still there?"})
            await again.wait_for("speech.start", timeout=WAIT_S)
            first = next(f for f in again.frames if f.get("n") is not None)
            assert first["n"] == 1  # a fresh stream on the node that runs the session now
            await again.close()
    finally:
        for node in nodes:
            node.kill()
