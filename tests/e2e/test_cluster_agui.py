"""AG-UI runs in cluster mode: a run posted to a node that does not run its session is served by that node, its events
streamed as they happen (not once the run has ended), its input applied once by the owner whichever node the run
is posted to; a client that goes away there interrupts the agent on the owner; the agent door creates its thread's
session on the least-loaded node. Real nodes on PostgreSQL and a Redis of the test's own, with an API key: the
caller's credential goes with every request a node sends another."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ag_ui_validate.pytest_plugin import assert_valid_agui

from tests.waiting import WAIT_S

from .cluster_support import FORWARDED, SECRET, RedisServer, cluster_node, start_all
from .server import EventStream, Server
from .test_agui import SseCapture, of_type, read_sse
from .test_agui_runs import run_input, texts, types

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.timeout(240)]

LONG = " ".join(f"w{i}" for i in range(100))  # two seconds of playout at the tests' 50 words per second
KEY = "cluster-agui-key-0123456789"
SCOPES = ["sessions:read", "sessions:write", "sessions:control", "events:read"]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
async def two(tmp_path: Path, database_url: str, redis: RedisServer) -> AsyncIterator[tuple[Server, Server]]:
    env = {
        "SWITCHBOARD_CLUSTER_SECRET": SECRET,
        "SWITCHBOARD_API_KEYS": json.dumps([{"key": KEY, "name": "front-end", "scopes": SCOPES}]),
    }
    nodes = [cluster_node(tmp_path, database_url, f"node-{x}", redis.url, **env) for x in "ab"]
    try:
        await start_all(nodes)
        yield nodes[0], nodes[1]
    finally:
        for node in nodes:
            node.stop()


async def session_on(http: httpx.AsyncClient, node: Server, turns: list[dict[str, Any]]) -> str:
    """A session run by ``node`` (a create that arrives forwarded is placed where it arrives)."""
    body = {"agent": "tester", "llm": {"provider": "scripted", "turns": turns}}
    r = await http.post(f"{node.url}/v1/sessions", json=body, headers={FORWARDED: SECRET})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def said(http: httpx.AsyncClient, node: Server, sid: str) -> list[str]:
    """What the agent has said so far: its messages in the chat (committed once played)."""
    r = await http.get(f"{node.url}/v1/sessions/{sid}/chat", params={"limit": 1000})
    return [i["text"] for i in r.json()["items"] if i["type"] == "message" and i["role"] == "assistant"]


async def owner_of(http: httpx.AsyncClient, node: Server, sid: str) -> str:
    return str((await http.get(f"{node.url}/v1/sessions/{sid}")).json()["owner_node"])


async def stream_run(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], at_start: Any
) -> tuple[list[dict[str, Any]], Any]:
    """The run posted to ``url``, read to its end, and what ``at_start()`` found when its ``RUN_STARTED`` arrived."""
    events: list[dict[str, Any]] = []
    found: Any = None
    async with http.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if events[-1]["type"] == "RUN_STARTED":
                    found = await at_start()
    return events, found


async def test_a_run_posted_to_another_node_streams_as_it_happens_and_is_injected_once(two: tuple[Server, Server]):
    owner, other = two
    turns = [
        {"text": f"Booking it. {LONG}", "tool_calls": [{"name": "book", "arguments": {"what": "table 7"}}]},
        {"text": "Done: {{tool_output:book}}."},
        {"text": "Working on it.", "tool_calls": [{"name": "progress", "arguments": {"steps": 3, "step_s": 0.2}}]},
        {"text": "It runs in the background."},  # the reply's next step, about the tool gone to the background
        {"text": "All done: {{tool_output:progress}}."},  # the deferred reply, about its result
    ]
    async with httpx.AsyncClient(timeout=WAIT_S, headers=AUTH) as http:
        sid = await session_on(http, owner, turns)
        body = run_input(sid, "r1", "book table 7")
        url = f"/v1/sessions/{sid}/ag-ui"
        events, said_then = await stream_run(http, f"{other.url}{url}", body, lambda: said(http, owner, sid))
        background = SseCapture()  # the run ends from the events alone: after the reply a background result owes
        report = run_input(sid, "r2", "and the report", "m2")
        assert await read_sse(http, f"{other.url}{url}", background, method="POST", json=report) == 200
        again = {node.url: SseCapture() for node in (owner, other)}
        for node in (owner, other):  # the same run posted again, to either node: nothing injected
            assert await read_sse(http, f"{node.url}{url}", again[node.url], method="POST", json=body) == 200
        chat = (await http.get(f"{owner.url}/v1/sessions/{sid}/chat")).json()["items"]
        assert await owner_of(http, other, sid) == "node-a"

    # RUN_STARTED arrived before the agent had said anything: the run came as it happened, not once it had ended
    assert said_then == []
    assert_valid_agui(events, max_warnings=0)
    assert types(events)[0] == "RUN_STARTED" and events[0]["runId"] == "r1" and events[0]["threadId"] == sid
    assert types(events)[-1] == "RUN_FINISHED" and "outcome" not in events[-1]
    assert texts(events) == [f"Booking it. {LONG}", "Done: booked table 7."]
    assert [e["toolCallName"] for e in of_type(events, "TOOL_CALL_START")] == ["book"]
    assert [e["content"] for e in of_type(events, "TOOL_CALL_RESULT")] == ["booked table 7"]

    later = background.events()
    assert_valid_agui(later, max_warnings=0)
    assert types(later).count("RUN_STARTED") == 1 and types(later)[-1] == "RUN_FINISHED"
    assert [e["content"]["message"] for e in of_type(later, "ACTIVITY_SNAPSHOT")] == [
        "step 1/3",
        "step 2/3",
        "step 3/3",
    ]
    assert texts(later) == ["Working on it.", "It runs in the background.", "All done: all 3 steps done."]

    user = [i["text"] for i in chat if i["type"] == "message" and i["role"] == "user"]
    assert user == ["book table 7", "and the report"]
    assert [c.events() for c in again.values()] == [events, events]  # the same run, from the log


async def test_a_client_that_goes_away_from_another_node_interrupts_the_agent(two: tuple[Server, Server]):
    owner, other = two
    talk = " ".join(f"w{i}" for i in range(300))
    async with httpx.AsyncClient(timeout=WAIT_S, headers=AUTH) as http:
        sid = await session_on(http, owner, [{"text": talk}])
        events = await EventStream.open(other, sid, additional_headers=AUTH)
        url = f"{other.url}/v1/sessions/{sid}/ag-ui"
        async with http.stream("POST", url, json=run_input(sid, "r1", "talk")) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if '"RUN_STARTED"' in line:
                    break
            await events.wait_for("speech.started")
        done = await events.wait_for("speech.done")
        assert done["data"]["interrupted"] is True
        interrupted = await events.wait_for("speech.interrupted")
        action = await events.wait_for("operator.action", lambda d: d["action"] == "interrupt")
        await events.close()

    assert interrupted["data"]["played_text"] != talk
    assert action["data"]["actor"] == "front-end"  # the caller, whose credential went to the owner
    assert action["data"]["speech_id"] == interrupted["data"]["speech_id"] == done["data"]["speech_id"]


async def test_the_agent_door_creates_the_thread_on_the_least_loaded_node(two: tuple[Server, Server]):
    owner, other = two
    async with httpx.AsyncClient(timeout=WAIT_S, headers=AUTH) as http:
        await session_on(http, other, [])  # node-b runs one session, node-a none
        url = f"{other.url}/v1/agents/tester/ag-ui"
        first, second = SseCapture(), SseCapture()
        assert await read_sse(http, url, first, method="POST", json=run_input("door-1", "r1", "hello")) == 200
        assert await read_sse(http, url, second, method="POST", json=run_input("door-1", "r2", "again")) == 200
        placed = await owner_of(http, other, "door-1")
        chat = (await http.get(f"{owner.url}/v1/sessions/door-1/chat")).json()["items"]

    assert placed == "node-a"
    for run in (first, second):
        assert_valid_agui(run.events(), max_warnings=0)
        assert types(run.events())[-1] == "RUN_FINISHED" and len(texts(run.events())) == 1  # the agent's answer
    assert [i["text"] for i in chat if i["type"] == "message" and i["role"] == "user"] == ["hello", "again"]
