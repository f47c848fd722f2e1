"""The MCP server at /mcp against a real server, driven by the MCP SDK's own client, unmodified, and by the MCP
Inspector's command line: the tools and their hints, input that the agent answers in the transcript, an interruption,
a running tool call listed and cancelled, the scopes and budgets of REST, the audit trail, 401 without a key."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult

from tests.retryable import RETRYABLE
from tests.waiting import WAIT_S, until

from .cluster_support import FORWARDED, SECRET, RedisServer, cluster_node, start_all
from .server import EventStream, Server

pytestmark = pytest.mark.e2e

OPERATOR = "mcp-operator-key-0123456789abcdef"
READER = "mcp-reader-key-0123456789abcdef"
KEYS = [
    {
        "key": OPERATOR,
        "name": "mcp-operator",
        "scopes": ["sessions:read", "sessions:write", "sessions:control", "tools:cancel", "events:read"],
    },
    {"key": READER, "name": "mcp-reader", "scopes": ["sessions:read"]},
]
MAX_TEXT_CHARS = 4000  # the server's, below the default 8000: the schema says which
LONG = " ".join(f"word{i}" for i in range(300))  # ~6 s of speech at 50 words per second
# the pinned Inspector (its command line runs on the Node.js the machines have, though it asks for a newer one)
INSPECTOR = "@modelcontextprotocol/inspector@2.12.0"
INSPECTOR_TIMEOUT_S = 300  # bound: a first npx run downloads the package (about 20 s), a later one takes seconds
TOOLS = {
    "list_sessions",
    "sessions_needing_attention",
    "get_session",
    "read_transcript",
    "inject_input",
    "say",
    "interrupt",
    "close_session",
    "list_tool_calls",
    "list_running_tool_calls",
    "get_tool_call",
    "cancel_tool_call",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(
        tmp_path_factory.mktemp("mcp"),
        SWITCHBOARD_API_KEYS=json.dumps(KEYS),
        SWITCHBOARD_MAX_TEXT_CHARS=str(MAX_TEXT_CHARS),
        SWITCHBOARD_ATTENTION_LONG_TOOL_S="0.5",
    ).start()
    try:
        yield srv
    finally:
        srv.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@asynccontextmanager
async def connect(server: Server, key: str, mode: str = "auto") -> AsyncIterator[Client]:
    """The SDK's client over Streamable HTTP, the key as its bearer (``mode="legacy"``: the initialize handshake)."""
    async with httpx2.AsyncClient(headers=bearer(key), timeout=WAIT_S) as http:
        async with Client(streamable_http_client(f"{server.url}/mcp", http_client=http), mode=mode) as client:
            yield client


async def call(client: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    """The structured answer of a tool call that must succeed."""
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, _text(result)
    assert isinstance(result.structured_content, dict)
    return result.structured_content


async def call_retrying(client: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    """``call``, sent again while the tool answers with one of the 503s the cluster documents as retryable (a session
    moving between nodes on a loaded machine), as an MCP client of a cluster does; a command carries an idempotency
    key, so a retry applies once."""
    deadline = time.monotonic() + WAIT_S
    while True:
        result = await client.call_tool(tool, arguments)
        refused = re.search(r"answered 503 (\w+)", _text(result)) if result.is_error else None
        if refused is None or refused.group(1) not in RETRYABLE or time.monotonic() > deadline:
            break
        await asyncio.sleep(1.0)
    assert not result.is_error, _text(result)
    assert isinstance(result.structured_content, dict)
    return result.structured_content


def _text(result: CallToolResult) -> str:
    return " ".join(getattr(block, "text", "") for block in result.content)


async def new_session(server: Server, *turns: dict[str, Any], agent: str = "tester") -> str:
    llm = {"provider": "scripted", "turns": list(turns), "fallback": {"text": "OK."}}
    async with httpx.AsyncClient(base_url=server.url, headers=bearer(OPERATOR), timeout=WAIT_S) as http:
        r = await http.post("/v1/sessions", json={"agent": agent, "llm": llm})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])


async def test_without_a_key_the_endpoint_answers_401(server: Server) -> None:
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as http:
        missing = await http.post("/mcp", json=initialize)
        wrong = await http.post("/mcp", json=initialize, headers=bearer("not-a-key"))
    assert missing.status_code == wrong.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    assert (missing.json()["code"], wrong.json()["code"]) == ("unauthenticated", "invalid_key")


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_the_tools_are_listed_with_their_hints_and_limits(server: Server, mode: str) -> None:
    async with connect(server, READER, mode) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        capabilities = client.server_capabilities
    assert capabilities.tools is not None and capabilities.tasks is None  # no MCP tasks: docs/mcp.md says why
    assert set(tools) == TOOLS
    for name in ("list_sessions", "sessions_needing_attention", "read_transcript", "list_running_tool_calls"):
        assert tools[name].annotations is not None and tools[name].annotations.read_only_hint is True
    for name in ("interrupt", "cancel_tool_call", "close_session"):
        hints = tools[name].annotations
        assert hints is not None and hints.read_only_hint is False and hints.destructive_hint is True
    for name in ("inject_input", "say"):
        hints = tools[name].annotations
        assert hints is not None and hints.destructive_hint is False and hints.idempotent_hint is False
    cancel = tools["cancel_tool_call"].annotations
    assert cancel is not None and cancel.idempotent_hint is True
    assert tools["inject_input"].input_schema["properties"]["text"]["maxLength"] == MAX_TEXT_CHARS
    assert tools["list_sessions"].input_schema["properties"]["limit"]["maximum"] == 200


async def test_input_is_answered_in_the_transcript_and_audited_once(server: Server) -> None:
    sid = await new_session(server, {"text": "Hello from the agent."})
    async with connect(server, OPERATOR) as client:
        listed = await call(client, "list_sessions", state="active")
        assert sid in [s["id"] for s in listed["items"]]
        accepted = await call(client, "inject_input", session_id=sid, text="hi there", idempotency_key="mcp-k1")
        # the same key again: the same answer, applied once (the REST route's idempotency)
        assert await call(client, "inject_input", session_id=sid, text="hi there", idempotency_key="mcp-k1") == accepted

        async def answered() -> list[dict[str, Any]]:
            items = (await call(client, "read_transcript", session_id=sid))["items"]
            return [i for i in items if i["type"] == "message" and i["role"] == "assistant"]

        replies = await until(answered, every_s=0.1)
        items = (await call(client, "read_transcript", session_id=sid))["items"]
    assert replies[0]["text"] == "Hello from the agent."
    assert [i["text"] for i in items if i["type"] == "message" and i["role"] == "user"] == ["hi there"]
    assert accepted["item_id"] in [i["id"] for i in items]

    stream = await EventStream.open(server, sid, additional_headers=bearer(OPERATOR))
    try:
        action = await stream.wait_for("operator.action")
        await stream.wait_for("speech.done")  # the reply's, after both calls: every action of theirs is in
        actions = [f["data"] for f in stream.frames if f["type"] == "operator.action"]
    finally:
        await stream.close()
    assert action["data"] == {
        "action": "input",
        "actor": "mcp-operator",
        "idempotency_key": "mcp-k1",
        "item_id": accepted["item_id"],
        "speech_id": accepted["speech_id"],
    }
    assert len(actions) == 1


async def test_interrupt_stops_the_agent_mid_speech(server: Server) -> None:
    sid = await new_session(server)
    async with connect(server, OPERATOR) as client:
        said = await call(client, "say", session_id=sid, text=LONG)

        async def heard() -> bool:  # some of it heard: the interrupted message holds it
            state = (await call(client, "get_session", session_id=sid))["agent_state"]
            async with httpx.AsyncClient(base_url=server.url, headers=bearer(OPERATOR), timeout=WAIT_S) as http:
                speech = (await http.get(f"/v1/sessions/{sid}/speeches/{said['speech_id']}")).json()
            return state == "speaking" and bool(speech["heard_text"])

        await until(heard, every_s=0.05)
        interrupted = await call(client, "interrupt", session_id=sid)
        items = (await call(client, "read_transcript", session_id=sid))["items"]
    assert interrupted == {"speech_id": said["speech_id"], "interrupted": True}
    spoken = [i for i in items if i["type"] == "message" and i["role"] == "assistant"]
    assert len(spoken) == 1 and spoken[0]["interrupted"] and LONG.startswith(spoken[0]["text"])
    assert spoken[0]["text"] != LONG


async def test_a_running_search_is_listed_needs_attention_and_is_cancelled(server: Server) -> None:
    search = {"name": "search_flights", "arguments": {"origin": "Paris", "destination": "Rome"}}
    sid = await new_session(server, {"text": "Searching.", "tool_calls": [search]}, agent="demo")
    async with connect(server, OPERATOR) as client, connect(server, READER) as reader:
        await call(client, "inject_input", session_id=sid, text="find me a flight")

        async def running() -> list[dict[str, Any]]:
            calls = (await call(client, "list_running_tool_calls"))["items"]
            return [c for c in calls if c["session_id"] == sid]

        [found] = await until(running, every_s=0.05)
        assert found["name"] == "search_flights" and found["cancellable"]

        async def flagged() -> list[dict[str, Any]]:
            sessions = (await call(reader, "sessions_needing_attention"))["items"]
            return [r for s in sessions if s["id"] == sid for r in s["attention"]]

        assert "tool_long_running" in [r["code"] for r in await until(flagged, every_s=0.1)]

        # a key without `tools:cancel` is answered a tool error naming the scope, and the call runs on
        refused = await reader.call_tool("cancel_tool_call", {"session_id": sid, "call_id": found["call_id"]})
        assert refused.is_error and "tools:cancel" in _text(refused)
        assert isinstance(refused.structured_content, dict) and refused.structured_content["status"] == 403
        refused = await reader.call_tool("inject_input", {"session_id": sid, "text": "hello"})
        assert refused.is_error and "sessions:control" in _text(refused)
        still = await call(reader, "get_tool_call", session_id=sid, call_id=found["call_id"])
        assert still["status"] == "running"

        cancelled = await call(client, "cancel_tool_call", session_id=sid, call_id=found["call_id"])
        assert cancelled["status"] == "cancelled"
        listed = await call(client, "list_tool_calls", session_id=sid, status="cancelled")
        assert [c["call_id"] for c in listed["items"]] == [found["call_id"]]
        again = await client.call_tool("cancel_tool_call", {"session_id": sid, "call_id": found["call_id"]})
        assert again.is_error and "already_ended" in _text(again)

        assert await call(client, "close_session", session_id=sid) == {"done": True}
        assert (await call(client, "get_session", session_id=sid))["state"] == "closed"


async def test_arguments_are_validated_with_the_limits_of_rest(server: Server) -> None:
    sid = await new_session(server)
    async with connect(server, OPERATOR) as client:
        too_long = await client.call_tool("say", {"session_id": sid, "text": "x" * (MAX_TEXT_CHARS + 1)})
        big_page = await client.call_tool("read_transcript", {"session_id": sid, "limit": 100_000})
        unknown = await client.call_tool("say", {"session_id": sid, "text": "hi", "volume": 11})
        path = await client.call_tool("get_session", {"session_id": "../tool-calls"})
        dots = [await client.call_tool("get_tool_call", {"session_id": sid, "call_id": d}) for d in (".", "..")]
    assert all(d.is_error and "call_id" in _text(d) for d in dots), [_text(d) for d in dots]  # not listToolCalls
    assert too_long.is_error and "text_too_long" in _text(too_long) and str(MAX_TEXT_CHARS) in _text(too_long)
    assert big_page.is_error and "limit" in _text(big_page)
    assert unknown.is_error and "volume" in _text(unknown)
    assert path.is_error and "session_id" in _text(path)  # never another REST path


async def test_a_tool_call_spends_the_budget_of_its_rest_call(tmp_path: Path) -> None:
    """A tool call spends its REST operation's budget, and each of the protocol's own requests (initialize,
    tools/list, ...) a read: none of them is free for a key to send without limit."""
    listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    raw = {**bearer(READER), "accept": "application/json, text/event-stream", "content-type": "application/json"}
    with Server(
        tmp_path, SWITCHBOARD_API_KEYS=json.dumps(KEYS), SWITCHBOARD_READ_BURST="8", SWITCHBOARD_READ_RATE_PER_S="0.01"
    ).start() as server:
        async with connect(server, READER) as client:
            await call(client, "list_sessions")
            async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as http:
                assert (await http.post("/mcp", json=listing, headers=raw)).status_code == 200
                for _ in range(8):  # bound: the burst
                    if (await http.get("/v1/sessions", headers=bearer(READER))).status_code == 429:
                        break
                limited = await client.call_tool("list_sessions", {})
                protocol = await http.post("/mcp", json=listing, headers=raw)
    assert limited.is_error and "429 rate_limited" in _text(limited) and "Retry after" in _text(limited)
    assert protocol.status_code == 429 and protocol.json()["code"] == "rate_limited", protocol.text
    assert protocol.headers["retry-after"]


@pytest.mark.postgres
@pytest.mark.timeout(240)
async def test_a_command_for_another_nodes_session_is_forwarded_to_it(
    tmp_path: Path, database_url: str, redis: RedisServer
) -> None:
    env = {"SWITCHBOARD_CLUSTER_SECRET": SECRET, "SWITCHBOARD_API_KEYS": json.dumps(KEYS)}
    owner, other = (cluster_node(tmp_path, database_url, f"node-{x}", redis.url, **env) for x in "ab")
    await start_all([owner, other])
    try:
        llm = {"provider": "scripted", "turns": [{"text": "Answered by node-a."}]}
        async with httpx.AsyncClient(headers=bearer(OPERATOR), timeout=WAIT_S) as http:
            # placed where it arrives (a request another node forwarded): node-a runs it
            body = {"id": "m1", "agent": "tester", "llm": llm}
            created = await http.post(f"{owner.url}/v1/sessions", json=body, headers={FORWARDED: SECRET})
            assert created.status_code == 201 and created.json()["owner_node"] == "node-a", created.text
        async with connect(other, OPERATOR) as client:
            accepted = await call_retrying(
                client, "inject_input", session_id="m1", text="hello", idempotency_key="m-k1"
            )

            async def answered() -> bool:
                items = (await call_retrying(client, "read_transcript", session_id="m1"))["items"]
                return any(i.get("role") == "assistant" and i["text"] == "Answered by node-a." for i in items)

            await until(answered, every_s=0.1)
        stream = await EventStream.open(owner, "m1", additional_headers=bearer(OPERATOR))
        try:
            action = await stream.wait_for("operator.action")
        finally:
            await stream.close()
        assert action["data"]["actor"] == "mcp-operator" and action["data"]["item_id"] == accepted["item_id"]
    finally:
        for node in (owner, other):
            node.stop()


@pytest.mark.timeout(INSPECTOR_TIMEOUT_S + 60)
def test_the_inspector_command_line_lists_the_tools(server: Server) -> None:
    auth = [f"Authorization: Bearer {READER}"]
    if shutil.which("npx") is None:
        message = "npx (Node.js) is needed to run the MCP Inspector"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    url = f"{server.url}/mcp"
    run = subprocess.run(
        ["npx", "-y", INSPECTOR, "--cli", url, "--transport", "http", "--method", "tools/list", "--header", *auth],
        capture_output=True,
        text=True,
        timeout=INSPECTOR_TIMEOUT_S,
        env={**os.environ, "npm_config_update_notifier": "false"},
    )
    assert run.returncode == 0, run.stderr
    listed = json.loads(run.stdout)
    assert {tool["name"] for tool in listed["tools"]} == TOOLS
    interrupt = next(tool for tool in listed["tools"] if tool["name"] == "interrupt")
    assert interrupt["annotations"]["destructiveHint"] is True
