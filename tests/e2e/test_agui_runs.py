"""AG-UI runs (``POST .../ag-ui``) on a real server: the stock TypeScript client (``HttpAgent`` from npm, pinned in
tests/agui_client) holds a conversation with a session, each run checked by the client's own verifier; a run holds
the reply to a background tool's result; a retried run injects once and continues from a position; an operator's
interrupt finishes a run ``cancelled``; a client that goes away interrupts the agent."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ag_ui_validate.pytest_plugin import assert_valid_agui

from tests.waiting import WAIT_S

from .server import EventStream, Server
from .test_agui import SseCapture, of_type, read_sse

pytestmark = pytest.mark.e2e

CLIENT_DIR = Path(__file__).resolve().parents[1] / "agui_client"
NPM_CI_TIMEOUT_S = 180  # bound: a first `npm ci` of the pinned client takes seconds; a slow registry, a minute or two


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("agui-runs")).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def node() -> str:
    """The node binary, with the pinned client installed (``npm ci``); CI fails without node and npm."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        message = "node and npm are needed to run the stock AG-UI client (tests/agui_client)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    if not (CLIENT_DIR / "node_modules" / "@ag-ui" / "client").exists():
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=CLIENT_DIR, check=True, timeout=NPM_CI_TIMEOUT_S)
    return node


async def run_client(node: str, url: str, thread: str, *texts: str) -> list[dict[str, Any]]:
    """What the stock client saw of each run (its events, messages, and the error it raised, if any)."""
    proc = await asyncio.create_subprocess_exec(
        node, "run_turns.mjs", url, thread, *texts, cwd=CLIENT_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), WAIT_S)
    assert proc.returncode == 0, err.decode()
    runs: list[dict[str, Any]] = json.loads(out)["runs"]
    return runs


async def new_session(client: httpx.AsyncClient, turns: list[dict[str, Any]], **extra: Any) -> str:
    body = {"agent": "tester", "llm": {"provider": "scripted", "turns": turns}, **extra}
    r = await client.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def run_input(sid: str, run_id: str, text: str, message_id: str = "m1") -> dict[str, Any]:
    return {
        "threadId": sid,
        "runId": run_id,
        "state": {},
        "messages": [{"id": message_id, "role": "user", "content": text}],
        "tools": [],
        "context": [],
        "forwardedProps": {},
    }


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def texts(events: list[dict[str, Any]]) -> list[str]:
    return [e["delta"] for e in of_type(events, "TEXT_MESSAGE_CONTENT")]


async def test_the_stock_client_holds_a_conversation_with_tools(server: Server, node: str):
    turns = [
        {"text": "Booking it.", "tool_calls": [{"name": "book", "arguments": {"what": "table 7"}}]},
        {"text": "Done: {{tool_output:book}}."},
        {"text": "You are welcome."},
    ]
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await new_session(client, turns)
        runs = await run_client(node, f"{server.url}/v1/sessions/{sid}/ag-ui", sid, "book table 7", "thanks")
        chat = (await client.get(f"/v1/sessions/{sid}/chat")).json()["items"]

    assert [run["error"] for run in runs] == [None, None]  # the client's verifier raised nothing
    first, second = (run["events"] for run in runs)
    assert types(first)[0] == "RUN_STARTED" and types(first)[-1] == "RUN_FINISHED"
    assert first[0]["runId"] == f"run-{sid}-0" and first[0]["threadId"] == sid
    assert "outcome" not in first[-1]
    order = [t for t in types(first) if t.startswith(("TEXT_MESSAGE", "TOOL_CALL"))]
    assert order[:3] == ["TOOL_CALL_START", "TOOL_CALL_ARGS", "TOOL_CALL_END"]
    assert sorted(order[3:]) == sorted(
        ["TOOL_CALL_RESULT"] + ["TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END"] * 2
    )
    assert order[-3:] == ["TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END"]  # the reply to the result
    assert texts(first) == ["Booking it.", "Done: booked table 7."]
    assert of_type(first, "TOOL_CALL_RESULT")[0]["content"] == "booked table 7"
    assert texts(second) == ["You are welcome."]
    # the user's own messages are the client's (never echoed back under another id); every event has its position
    assert all(e.get("role") != "user" for e in of_type(first + second, "TEXT_MESSAGE_START"))
    positions = [e["rawEvent"]["seq"] for e in first + second]
    assert positions == sorted(positions) and positions[0] > 0
    held = [(m["role"], m.get("content")) for m in runs[-1]["messages"] if m["role"] in ("user", "assistant")]
    assert held[0] == ("user", "book table 7") and held[-2:] == [("user", "thanks"), ("assistant", "You are welcome.")]
    assert [i["text"] for i in chat if i["type"] == "message" and i["role"] == "user"] == ["book table 7", "thanks"]


async def test_a_run_holds_the_reply_to_its_background_tools_result(server: Server):
    turns = [
        {"text": "Working on it.", "tool_calls": [{"name": "progress", "arguments": {"steps": 3, "step_s": 0.2}}]},
        {"text": "It runs in the background."},  # the reply's next step, about the tool gone to the background
        {"text": "All done: {{tool_output:progress}}."},  # the deferred reply, about its result
    ]
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await new_session(client, turns)
        capture = SseCapture()
        url = f"/v1/sessions/{sid}/ag-ui"
        assert await read_sse(client, url, capture, method="POST", json=run_input(sid, "r1", "go")) == 200

    events = capture.events()
    assert_valid_agui(events, max_warnings=0)
    assert types(events).count("RUN_STARTED") == 1 and types(events)[-1] == "RUN_FINISHED"
    assert [e["content"]["message"] for e in of_type(events, "ACTIVITY_SNAPSHOT")] == [
        "step 1/3",
        "step 2/3",
        "step 3/3",
    ]
    assert of_type(events, "TOOL_CALL_RESULT")[0]["content"] == "all 3 steps done"
    # the deferred reply about the result is in the run, after the result
    assert texts(events) == ["Working on it.", "It runs in the background.", "All done: all 3 steps done."]
    assert types(events).index("TOOL_CALL_RESULT") < len(events) - 4


async def test_a_retried_run_injects_once_and_continues_from_a_position(server: Server):
    turns = [{"text": "one two three", "tool_calls": [{"name": "book", "arguments": {"what": "a"}}]}, {"text": "ok"}]
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await new_session(client, turns)
        url = f"/v1/sessions/{sid}/ag-ui"
        body = run_input(sid, "r1", "book a")
        first, again, rest = SseCapture(), SseCapture(), SseCapture()
        assert await read_sse(client, url, first, method="POST", json=body) == 200
        assert await read_sse(client, url, again, method="POST", json=body) == 200
        cut = first.events()[3]["rawEvent"]["seq"]
        headers = {"Last-Event-ID": str(cut)}
        # continued: known by its runId (the client's messages have grown since, with what it got)
        grown = {**body, "messages": [*body["messages"], {"id": "a1", "role": "assistant", "content": "one two"}]}
        assert await read_sse(client, url, rest, method="POST", json=grown, headers=headers) == 200
        other = {**body, "messages": [{"id": "m2", "role": "user", "content": "something else"}]}
        reused = await client.post(url, json=other)
        chat = (await client.get(f"/v1/sessions/{sid}/chat")).json()["items"]

    assert [i["text"] for i in chat if i["type"] == "message" and i["role"] == "user"] == ["book a"]
    assert again.events() == first.events()  # the same run, replayed from the log
    assert reused.status_code == 409 and reused.json()["code"] == "idempotency_key_reused"
    # continued after the position: a run of its own again, then exactly what came after it
    tail = [e for e in first.events() if e["rawEvent"]["seq"] > cut]
    assert rest.events()[0]["type"] == "RUN_STARTED" and rest.events()[0]["runId"] == "r1"
    assert [e["type"] for e in rest.events()[1:]] == [e["type"] for e in tail]
    assert_valid_agui(rest.events(), max_warnings=0)


async def test_an_operators_interrupt_finishes_the_run_cancelled(server: Server):
    long = " ".join(f"w{i}" for i in range(300))
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await new_session(client, [{"text": long}])
        events = await EventStream.open(server, sid)
        capture = SseCapture()
        url = f"/v1/sessions/{sid}/ag-ui"
        reader = asyncio.create_task(read_sse(client, url, capture, method="POST", json=run_input(sid, "r1", "talk")))
        await events.wait_for("speech.started")
        assert (await client.post(f"/v1/sessions/{sid}/interrupt")).json()["interrupted"] is True
        assert await asyncio.wait_for(reader, WAIT_S) == 200
        played = (await events.wait_for("speech.interrupted"))["data"]["played_text"]
        await events.close()

    ag = capture.events()
    assert_valid_agui(ag, max_warnings=0)
    assert ag[-1]["type"] == "RUN_FINISHED" and ag[-1]["outcome"] == {"type": "cancelled"}
    assert "".join(texts(ag)) == played != long  # what was heard stays delivered


async def test_a_client_that_goes_away_interrupts_the_agent(server: Server):
    long = " ".join(f"w{i}" for i in range(300))
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sid = await new_session(client, [{"text": long}])
        events = await EventStream.open(server, sid)
        url = f"/v1/sessions/{sid}/ag-ui"
        async with client.stream("POST", url, json=run_input(sid, "r1", "talk")) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if '"RUN_STARTED"' in line:
                    break
            await events.wait_for("speech.started")
        done = await events.wait_for("speech.done")
        interrupted = await events.wait_for("speech.interrupted")
        action = await events.wait_for("operator.action", lambda d: d["action"] == "interrupt")
        await events.close()

    assert done["data"]["interrupted"] is True and action["data"]["speech_id"] == interrupted["data"]["speech_id"]


async def test_the_agent_door_creates_the_thread_session_then_continues_it(server: Server, node: str):
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        runs = await run_client(node, f"{server.url}/v1/agents/tester/ag-ui", "agui-thread-1", "hello", "again")
        session = (await client.get("/v1/sessions/agui-thread-1")).json()
        wrong = await client.post("/v1/agents/other/ag-ui", json=run_input("agui-thread-1", "r9", "hi"))
        none = await client.post(
            "/v1/agents/tester/ag-ui", json={**run_input("agui-thread-2", "r1", "x"), "messages": []}
        )

    assert [run["error"] for run in runs] == [None, None]
    assert session["agent"] == "tester"
    # an agent without a model answers through the stand-in: its sentence saying how to call the agent's tools
    said = [texts(run["events"]) for run in runs]
    assert [len(t) for t in said] == [1, 1] and all(t[0].startswith("No model is configured") for t in said), said
    assert wrong.status_code == 409 and wrong.json()["code"] == "thread_agent_mismatch"
    assert none.status_code == 422 and none.json()["code"] == "no_user_message"
