"""Cluster mode with three real nodes on loopback, PostgreSQL and a Redis of the tests' own: any node takes every
command (forwarded to the owner, idempotency included); a node killed (SIGKILL) or frozen past its lease (SIGSTOP)
has its sessions adopted by the others through recovery; a node stopped (SIGTERM) hands its sessions over; Redis can
go away; streams resume on any node."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from switchboard.runtime.recovery import RESTART_OUTPUT
from tests.waiting import WAIT_S

from .cluster_support import (
    FORWARDED,
    LEASE_S,
    SECRET,
    Load,
    RedisServer,
    ResumingStream,
    assert_gap_free,
    cluster_node,
    drain_stop,
    retried,
    start_all,
    until,
    up,
)
from .server import EventStream, Server

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.timeout(240)]


LONG = " ".join(["word"] * 300)  # six seconds of speech at the tests' 50 words per second
PIN = {FORWARDED: SECRET}  # a request forwarded by a node is placed where it arrives: the tests pick the owner


async def _pinned(http: httpx.AsyncClient, node: Server, node_id: str, turns: list[dict[str, Any]]) -> str:
    llm = {"provider": "scripted", "turns": turns, "fallback": {"text": "Noted."}}
    r = await http.post(f"{node.url}/v1/sessions", json={"agent": "tester", "llm": llm}, headers=PIN)
    assert r.status_code == 201, r.text
    assert r.json()["owner_node"] == node_id
    return str(r.json()["id"])


async def _session(http: httpx.AsyncClient, node: Server, sid: str) -> dict[str, Any]:
    r = await http.get(f"{node.url}/v1/sessions/{sid}")
    assert r.status_code == 200, r.text
    return dict(r.json())


async def _calls(http: httpx.AsyncClient, node: Server, sid: str) -> list[dict[str, Any]]:
    r = await http.get(f"{node.url}/v1/sessions/{sid}/tool-calls")
    assert r.status_code == 200, r.text
    return list(r.json()["items"])


async def _chat(http: httpx.AsyncClient, node: Server, sid: str) -> list[dict[str, Any]]:
    r = await http.get(f"{node.url}/v1/sessions/{sid}/chat", params={"limit": 1000})
    assert r.status_code == 200, r.text
    return list(r.json()["items"])


def _types_of(frames: list[dict[str, Any]], sid: str) -> list[str]:
    return [f["type"] for f in frames if f["session_id"] == sid]


async def test_three_nodes_a_killed_and_a_frozen_owner_lose_nothing(
    tmp_path: Path, database_url: str, redis: RedisServer
):
    """SIGKILL an owner mid-tool and mid-speech: the others adopt its sessions (the tool ends `interrupted`, a
    `retry` tool runs again, accepted input is answered), and stream clients on it resume on another node with their
    position, seeing every event once. SIGSTOP an owner past its lease: its session moves, and once it runs again
    none of its writes land. Forwarded requests need the cluster secret."""
    nodes = [
        cluster_node(tmp_path, database_url, f"node-{x}", redis.url, SWITCHBOARD_CLUSTER_SECRET=SECRET) for x in "abc"
    ]
    a, b, c = nodes
    streams: list[ResumingStream] = []
    try:
        await start_all(nodes)
        async with httpx.AsyncClient(timeout=30) as http:
            for wrong in ("", "not-the-secret-" * 3):
                r = await http.post(f"{a.url}/v1/sessions", json={"agent": "tester"}, headers={FORWARDED: wrong})
                assert r.status_code == 403 and r.json()["code"] == "forward_unauthenticated", r.text

            multi = ResumingStream.multi(nodes, first=a)
            streams.append(multi)
            await until(lambda: _true(multi.connections))
            tool = await _pinned(http, a, "node-a", [{"text": "On it.", "tool_calls": [_call("slow", seconds=60)]}])
            rerun = await _pinned(http, a, "node-a", [{"text": "Again.", "tool_calls": [_call("rerun", seconds=2)]}])
            speech = await _pinned(http, a, "node-a", [{"text": LONG}])
            sids = [tool, rerun, speech]
            stream = ResumingStream.session(nodes, tool, first=a)
            streams.append(stream)
            listed = (await http.get(f"{c.url}/v1/cluster/nodes")).json()["items"]
            assert {(n["id"], n["state"], n["mode"], n["sessions"]) for n in listed} == {
                ("node-a", "live", "cluster", 3),
                ("node-b", "live", "cluster", 0),
                ("node-c", "live", "cluster", 0),
            }
            # a new session goes to the least-loaded node, wherever it is created
            r = await http.post(f"{a.url}/v1/sessions", json={"agent": "tester"})
            assert r.status_code == 201 and r.json()["owner_node"] in ("node-b", "node-c"), r.text
            created = r.json()["id"]
            assert (await retried(lambda: http.delete(f"{a.url}/v1/sessions/{created}"))).status_code == 204

            for sid in (tool, speech):  # through another node: forwarded to the owner, with the secret
                r = await http.post(f"{b.url}/v1/sessions/{sid}/input", json={"text": "go"})
                assert r.status_code == 202, r.text
            # the same Idempotency-Key on two nodes: applied once, the same answer from both
            key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
            first = await http.post(f"{b.url}/v1/sessions/{rerun}/input", json={"text": "go"}, headers=key)
            second = await http.post(f"{c.url}/v1/sessions/{rerun}/input", json={"text": "go"}, headers=key)
            assert first.status_code == second.status_code == 202, (first.text, second.text)
            assert first.json() == second.json() and second.headers.get("idempotent-replayed") == "true"
            await multi.wait_for(
                lambda fr: (
                    "tool.started" in _types_of(fr, tool)
                    and "tool.started" in _types_of(fr, rerun)
                    and "speech.started" in _types_of(fr, speech)
                )
            )
            # a read on a node that does not run the session is answered as its owner knows it (speaking now)
            seen = await _session(http, c, speech)
            assert (seen["agent_state"], seen["owner_node"]) == ("speaking", "node-a"), seen
            assert seen["current_speech_id"] == (await _session(http, a, speech))["current_speech_id"] is not None
            late = {"text": "still there?", "interrupt": False}  # queued behind the speech, accepted before the kill
            r = await http.post(f"{c.url}/v1/sessions/{speech}/input", json=late)
            assert r.status_code == 202, r.text

            a.kill()
            for sid in sids:
                await until(lambda sid=sid: _adopted(http, b, sid, {"node-b", "node-c"}), timeout_s=LEASE_S + 40)
            await until(lambda: _call_is(http, b, tool, "slow", "interrupted"))
            await until(lambda: _call_is(http, b, rerun, "rerun", "completed"))
            await until(lambda: _answered(http, b, speech, "still there?"))
            users = [i["text"] for i in await _chat(http, c, rerun) if i["type"] == "message" and i["role"] == "user"]
            assert users == ["go"]
            await multi.wait_for(lambda fr: all("session.recovered" in _types_of(fr, sid) for sid in sids))
            await stream.wait_for(lambda fr: "session.recovered" in _types_of(fr, tool))
            assert len(multi.connections) >= 2 and len(stream.connections) >= 2  # resumed on another node
            assert_gap_free(stream.frames, [tool])
            assert_gap_free(multi.frames, sids)
            cursors = [f["cursor"] for f in multi.frames]
            assert cursors == sorted(set(cursors))

            # SIGSTOP an owner past its lease, mid-tool: the session moves; SIGCONT: none of its writes land
            frozen = await _pinned(http, b, "node-b", [{"text": "Hold on.", "tool_calls": [_call("slow", seconds=3)]}])
            assert (await http.post(f"{c.url}/v1/sessions/{frozen}/input", json={"text": "go"})).status_code == 202
            await multi.wait_for(lambda fr: "tool.started" in _types_of(fr, frozen))
            assert b.proc is not None
            b.proc.send_signal(signal.SIGSTOP)
            try:
                await until(lambda: _adopted(http, c, frozen, {"node-c"}), timeout_s=LEASE_S + 40)
                await until(lambda: _call_is(http, c, frozen, "slow", "interrupted"))
                # and c has answered that end (its deferred reply): all it writes, so what follows is b's alone
                await until(lambda: _replied_to_last_output(http, c, frozen))
                before = (await _chat(http, c, frozen), await _calls(http, c, frozen))
            finally:
                b.proc.send_signal(signal.SIGCONT)
            await asyncio.sleep(6)  # its tool's 3 s are over: it tried to write the result, and to renew its lease
            assert (await _chat(http, c, frozen), await _calls(http, c, frozen)) == before
            outputs = [i for i in before[0] if i["type"] == "function_call_output"]
            assert len(outputs) == 1 and outputs[0]["output"] == RESTART_OUTPUT, outputs
            await until(lambda: _node_live(http, c, "node-b"))  # a member again, owning nothing it lost
    finally:
        for s in streams:
            await s.aclose()
        for node in nodes:
            node.kill()


async def test_redis_outage_and_rolling_restart_under_load(tmp_path: Path, database_url: str, redis: RedisServer):
    """Commands keep working without Redis and streams go on from the database (the metric and /readyz say so),
    catching up gap-free when it returns; then every node is restarted in turn (SIGTERM: it hands its sessions over)
    under load, with no 5xx but the documented retries, every accepted input answered, every stream gap-free."""
    nodes = [
        cluster_node(tmp_path, database_url, f"node-{x}", redis.url, SWITCHBOARD_CLUSTER_SECRET=SECRET) for x in "abc"
    ]
    _, b, c = nodes
    streams: list[ResumingStream] = []
    load: Load | None = None
    try:
        await start_all(nodes)
        async with httpx.AsyncClient(timeout=30) as http:
            multi = ResumingStream.multi(nodes, first=c)
            streams.append(multi)
            await until(lambda: _true(multi.connections))
            sids = [await _pinned(http, node, f"node-{x}", []) for node, x in zip(nodes, "abc", strict=True)]
            remote = ResumingStream.session(nodes, sids[0], first=b)  # sids[0] runs on node a
            streams.append(remote)
            load = Load(nodes, sids)
            await remote.wait_for(lambda fr: "speech.done" in _types_of(fr, sids[0]))

            redis.stop()
            await until(lambda: _redis_down(http, b))
            seen = len(remote.frames)
            await remote.wait_for(lambda fr: len(fr) > seen + 5, timeout_s=WAIT_S)  # read from the database meanwhile
            redis.start()
            await until(lambda: _redis_up(http, nodes))

            for node in nodes:  # a rolling restart
                await asyncio.to_thread(drain_stop, node)
                await asyncio.to_thread(node.start, 90)
            await asyncio.sleep(2)
            await load.aclose()
            assert load.errors == [], load.errors[:5]
            print(f"rolling restart: {load.retries} retries, an input waited {load.longest_s:.2f}s at most")
            for sid in sids:
                await until(lambda sid=sid: _all_answered(http, nodes, sid, load.accepted[sid]), timeout_s=60)
            assert len(multi.connections) >= 2 and len(remote.connections) >= 2
            stored = _keys(await _everything(random.choice(up(nodes))), sids)
            await multi.wait_for(lambda fr: len(_keys(fr, sids)) >= len(stored))
            await remote.wait_for(lambda fr: len(fr) >= len([k for k in stored if k[0] == sids[0]]))
            assert sorted(_keys(multi.frames, sids)) == sorted(stored)  # each event once, none missing
            assert_gap_free(multi.frames, sids)
            assert_gap_free(remote.frames, [sids[0]])
            cursors = [f["cursor"] for f in multi.frames]
            assert cursors == sorted(set(cursors))
    finally:
        if load is not None and not load._stop.is_set():
            await load.aclose()
        for s in streams:
            await s.aclose()
        for node in nodes:
            node.kill()


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


async def _true(value: Any) -> bool:
    return bool(value)


async def _adopted(http: httpx.AsyncClient, node: Server, sid: str, owners: set[str]) -> bool:
    found = await _session(http, node, sid)
    return found["owner_node"] in owners and found["state"] == "active"


async def _call_is(http: httpx.AsyncClient, node: Server, sid: str, name: str, status: str) -> bool:
    calls = [c for c in await _calls(http, node, sid) if c["name"] == name]
    return bool(calls) and calls[-1]["status"] == status


async def _replied_to_last_output(http: httpx.AsyncClient, node: Server, sid: str) -> bool:
    items = await _chat(http, node, sid)
    outputs = [n for n, i in enumerate(items) if i["type"] == "function_call_output"]
    return bool(outputs) and any(i["type"] == "message" and i["role"] == "assistant" for i in items[outputs[-1] + 1 :])


async def _answered(http: httpx.AsyncClient, node: Server, sid: str, text: str) -> bool:
    items = [i for i in await _chat(http, node, sid) if i["type"] == "message"]
    at = next((n for n, i in enumerate(items) if i["role"] == "user" and i["text"] == text), None)
    return at is not None and any(i["role"] == "assistant" and i["text"] for i in items[at + 1 :])


async def _node_live(http: httpx.AsyncClient, node: Server, node_id: str) -> bool:
    r = await http.get(f"{node.url}/v1/cluster/nodes")
    return any(n["id"] == node_id and n["state"] == "live" for n in r.json()["items"])


async def _metric(http: httpx.AsyncClient, node: Server, name: str) -> float | None:
    r = await http.get(f"{node.url}/metrics")
    for line in r.text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


async def _redis_down(http: httpx.AsyncClient, node: Server) -> bool:
    ready = await http.get(f"{node.url}/readyz")
    degraded = ready.status_code == 200 and "redis unavailable" in str(ready.json().get("detail"))
    return degraded and await _metric(http, node, "switchboard_cluster_redis_up") == 0


async def _redis_up(http: httpx.AsyncClient, nodes: list[Server]) -> bool:
    return all([await _metric(http, node, "switchboard_cluster_redis_up") == 1 for node in nodes])


async def _all_answered(http: httpx.AsyncClient, nodes: list[Server], sid: str, accepted: list[str]) -> bool:
    """Every accepted input in the chat once, in order, and the last one answered."""
    items = [i for i in await _chat(http, random.choice(up(nodes)), sid) if i["type"] == "message"]
    users = [i["text"] for i in items if i["role"] == "user"]
    assert users == accepted[: len(users)], (users, accepted)
    return users == accepted and items[-1]["role"] == "assistant"


async def _everything(node: Server) -> list[dict[str, Any]]:
    """Every event of the cluster, replayed by a fresh multi-session stream (read until it is quiet)."""
    frames: list[dict[str, Any]] = []
    async with websockets.connect(f"{node.ws_url}/v1/events?cursor=0") as ws:
        while True:
            try:
                async with asyncio.timeout(2.0):  # bound: read until quiet: expected to run out
                    frames.append(json.loads(await ws.recv()))
            except TimeoutError:
                return frames


def _keys(frames: list[dict[str, Any]], sids: list[str]) -> list[tuple[str, int]]:
    return [(f["session_id"], f["seq"]) for f in frames if f["session_id"] in sids]


async def test_filtered_session_streams_on_every_node_get_each_event_once_in_order(
    tmp_path: Path, database_url: str, redis: RedisServer
):
    """A session on node-a reports progress; streams filtered to `tool.progress` on node-a and node-b, an unfiltered
    one on node-b and one that joins node-b halfway with `since` each get every matching event once, in order, and
    end with the session. On node-b the events come through Redis and are put in order once for all its streams."""
    nodes = [
        cluster_node(tmp_path, database_url, f"node-{x}", redis.url, SWITCHBOARD_CLUSTER_SECRET=SECRET) for x in "ab"
    ]
    a, b = nodes
    steps = 60
    try:
        await start_all(nodes)
        async with httpx.AsyncClient(timeout=30) as http:
            call = _call("progress", steps=steps, step_s=0.05)
            sid = await _pinned(http, a, "node-a", [{"text": "Counting.", "tool_calls": [call]}])
            filtered = [await EventStream.open(n, sid, types="tool.progress") for n in (a, a, b, b, b, b, b, b)]
            everything = await EventStream.open(b, sid)
            streams = [*filtered, everything]
            await until(lambda: _subscribers(http, nodes, len(streams)))
            r = await http.post(f"{a.url}/v1/sessions/{sid}/input", json={"text": "go"})
            assert r.status_code == 202, r.text
            await until(lambda: _true(len(filtered[-1].frames) >= steps // 2))
            since = filtered[-1].frames[steps // 4]["seq"]
            late = await EventStream.open(b, sid, since=since, types="tool.progress")
            await until(lambda: _true(all(len(s.frames) >= steps for s in filtered)), timeout_s=90)
            assert (await http.delete(f"{a.url}/v1/sessions/{sid}")).status_code == 204
            truth = await EventStream.open(a, sid, types="tool.progress")  # replayed from the database
            await until(lambda: _true(all(s.closed for s in [*streams, late, truth])), timeout_s=60)
            # a gap (none is expected here) is read from the database once per session per node, not per stream
            assert await _metric(http, b, "switchboard_cluster_session_gap_reads_total") <= 1
        expected = [f["seq"] for f in truth.frames if f["type"] == "tool.progress"]
        assert len(expected) == steps
        for stream in filtered:
            assert [f["seq"] for f in stream.frames if f["type"] == "tool.progress"] == expected
            assert stream.closed == (1000, "session closed")  # at the session's end, filtered out
        assert [f["seq"] for f in late.frames if f["type"] == "tool.progress"] == [s for s in expected if s > since]
        assert_gap_free(everything.frames, [sid])
        assert everything.frames[-1]["type"] == "session.closed"
    finally:
        for node in nodes:
            node.stop()


async def _metric(http: httpx.AsyncClient, node: Server, name: str) -> float:
    text = (await http.get(f"{node.url}/metrics")).text
    return float(next(ln for ln in text.splitlines() if ln.startswith(f"{name} ")).split()[1])


async def _subscribers(http: httpx.AsyncClient, nodes: list[Server], want: int) -> bool:
    counts = [await _metric(http, node, "switchboard_event_subscribers") for node in nodes]
    return sum(counts) >= want
