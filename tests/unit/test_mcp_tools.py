"""MCP tools against real MCP servers started by the tests (``tests/mcp_server.py``: streamable HTTP on a loopback
port, and over stdio), and against misbehaving ones: a server that refuses connections, one that never answers,
and one that answers too much. Every call ends once, with an output, within its timeout."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import mcp_types
import pytest

from switchboard import Agent, RunContext, function_tool
from switchboard.integrations.agents_file import AgentsFileError, load_agents_file, read_agents_file
from switchboard.integrations.mcp_tools import (
    MAX_PROGRESS_UPDATES,
    MCPServer,
    MCPServerHTTP,
    MCPServerStdio,
    MCPTool,
)
from switchboard.integrations.webhooks import Webhooks
from switchboard.runtime.agent import AgentRegistry
from switchboard.runtime.llm.scripted import Turn
from switchboard.runtime.options import SessionOptions
from switchboard.runtime.playout import SimulatedPlayout
from switchboard.runtime.ports import Reported
from switchboard.runtime.recovery import recover
from switchboard.runtime.session import AgentSession
from switchboard.runtime.status import SessionStatus
from switchboard.runtime.tools import ToolStatus
from tests.mcp_support import SERVER_SCRIPT, ServerLog, running_http_server
from tests.ports import free_port
from tests.waiting import until

from .harness import WPS, Harness

pytestmark = pytest.mark.timeout(120)
HELD: list[asyncio.StreamWriter] = []  # the connections the hanging server holds (none outlives its test)


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[tuple[str, ServerLog, subprocess.Popen[bytes]]]:
    with running_http_server(tmp_path) as server:
        yield server


@pytest.fixture
async def hanging_server() -> AsyncIterator[str]:
    """Accepts connections and never answers."""
    held: list[asyncio.StreamWriter] = HELD

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        for writer in held:
            writer.close()
        held.clear()
        server.close()
        await server.wait_closed()


def call(name: str, arguments: dict[str, Any] | None = None, call_id: str = "c1") -> dict[str, Any]:
    return {"text": "One moment.", "tool_calls": [{"id": call_id, "name": name, "arguments": arguments or {}}]}


def ended(h: Harness, call_id: str = "c1") -> Any:
    return h.wait_for("tool.ended", lambda e: e.data["call_id"] == call_id)


def server_children() -> list[int]:
    """The test server processes this process started that are still running (not reaped)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"mcp_server.py" in cmdline and b"stdio" in cmdline:
            found.append(int(entry.name))
    return found


async def test_the_model_sees_the_servers_tools_and_a_call_commits_its_output_with_progress(http_server):
    url, log, _ = http_server
    agent = Agent(instructions="Use the tools.", mcp_servers=[MCPServerHTTP(url, timeout_s=20)])
    turns = [call("lookup", {"order_id": "A-1"}), {"text": "It saw: {{tool_output:lookup}}"}]
    async with Harness(agent, turns) as h:
        await h.session.input("where is my order")
        done = await ended(h)
        assert done.data["status"] == "completed", done.data
        await h.idle()
        tools = {t["name"]: t for t in h.llm.requests[0].tools}
        assert {"lookup", "slow", "broken", "huge", "optional"} <= set(tools)
        assert tools["lookup"]["description"] == "Look up an order."
        assert tools["lookup"]["parameters"]["required"] == ["order_id"]
        progress = [(e.data["message"], e.data["progress"]) for e in h.of_type("tool.progress")]
        assert progress == [("looking in the warehouse", 0.5), ("2 of 2", 1.0)]
        outputs = [item for item in h.summary() if item[0] == "output" and item[1] == "lookup"]
        assert outputs[-1] == ("output", "lookup", "order A-1: shipped")
        assert "called lookup A-1" in log.lines()
        h.check_invariants()


async def test_bad_arguments_are_refused_before_the_server_is_called_and_a_null_optional_is_not_given(http_server):
    url, _, _ = http_server
    agent = Agent(instructions="Use the tools.", mcp_servers=[MCPServerHTTP(url, timeout_s=20)])
    turns = [
        {
            "text": "Checking.",
            "tool_calls": [
                {"id": "bad", "name": "optional", "arguments": {"city": 3}},
                {"id": "good", "name": "optional", "arguments": {"city": "Oslo", "party": None}},
            ],
        }
    ]
    async with Harness(agent, turns) as h:
        await h.session.input("a table")
        bad, good = await ended(h, "bad"), await ended(h, "good")
        assert bad.data["status"] == "failed"
        assert bad.data["output"].startswith("Invalid arguments for optional:"), bad.data
        assert "3 is not of type 'string'" in bad.data["output"]
        assert good.data["status"] == "completed", good.data
        assert good.data["output"] == "Oslo for None"


async def test_an_operator_cancel_sends_notifications_cancelled_and_the_call_ends_cancelled_once(http_server):
    url, log, _ = http_server
    server = MCPServerHTTP(url, timeout_s=60, policies={"slow": {"allow_cancellation": True}})
    agent = Agent(instructions="Use the tools.", mcp_servers=[server])
    async with Harness(agent, [call("slow")]) as h:
        await h.session.input("take your time")
        await log.shows("called slow")
        info = await h.session.cancel_tool("c1")
        assert info.status is ToolStatus.CANCELLED
        await log.shows("cancelled slow")  # the server heard of it and stopped the tool
        await h.tools_done()
        assert [e.data["status"] for e in h.of_type("tool.ended")] == ["cancelled"]
        h.check_invariants()


async def test_a_call_past_its_timeout_fails_saying_so_and_is_cancelled_at_the_server(http_server):
    url, log, _ = http_server
    server = MCPServerHTTP(url, timeout_s=60, policies={"slow": {"timeout_s": 1.0}})
    async with Harness(Agent(instructions="Use the tools.", mcp_servers=[server]), [call("slow")]) as h:
        await h.session.input("take your time")
        done = await ended(h)
        assert done.data["status"] == "failed", done.data
        assert done.data["output"] == f"MCP server {url}: no answer within 1 s."
        await log.shows("cancelled slow")
        h.check_invariants()


async def test_an_error_result_is_an_error_output(http_server):
    url, _, _ = http_server
    async with Harness(Agent(instructions="x", mcp_servers=[MCPServerHTTP(url)]), [call("broken")]) as h:
        await h.session.input("try it")
        done = await ended(h)
        assert done.data["status"] == "failed", done.data
        assert "the warehouse is closed" in done.data["output"]
        item = next(i for i in h.chat() if getattr(i, "call_id", None) == "c1" and hasattr(i, "is_error"))
        assert item.is_error


async def test_a_server_that_answers_too_much_fails_the_call_after_reading_at_most_its_cap(http_server):
    url, _, _ = http_server
    server = MCPServerHTTP(url, timeout_s=20, max_answer_bytes=256 * 1024)
    async with Harness(Agent(instructions="x", mcp_servers=[server]), [call("huge")]) as h:
        await h.session.input("everything please")
        done = await ended(h)
        assert done.data["status"] == "failed", done.data
        assert done.data["output"] == f"MCP server {url}: it answered more than 262144 bytes."


async def test_a_server_that_went_down_gives_an_error_output_at_once(http_server):
    url, _, proc = http_server
    server = MCPServerHTTP(url, timeout_s=30)
    await server.refresh()  # listed while it was up
    proc.terminate()
    proc.wait()
    async with Harness(Agent(instructions="x", mcp_servers=[server]), [call("lookup", {"order_id": "A-1"})]) as h:
        await h.session.input("where is my order")
        done = await h.wait_for("tool.ended", timeout=10)  # bound: refused at once, well before the 30 s timeout
        assert done.data["status"] == "failed", done.data
        assert done.data["output"].startswith(f"MCP server {url}: the call of lookup failed (ConnectError")


async def test_a_server_that_refuses_connections_leaves_the_agent_its_own_tools_and_the_session_starts():
    @function_tool
    async def own(ctx: RunContext) -> str:
        """An own tool."""
        return "mine"

    server = MCPServerHTTP(f"http://127.0.0.1:{free_port()}/mcp", timeout_s=30)
    agent = Agent(instructions="x", tools=[own], mcp_servers=[server])
    async with asyncio.timeout(10):  # bound: a refused connection is known at once, not after the timeout
        async with Harness(agent) as h:
            assert set(h.session.model_tools()) == {"own"}


async def test_a_server_that_never_answers_fails_the_listing_and_the_call_within_their_timeouts(hanging_server):
    server = MCPServerHTTP(hanging_server, timeout_s=1.0)
    async with asyncio.timeout(15):  # bound: the listing gives up after timeout_s and the grace to close
        await server.refresh()
    assert list(server.tools()) == []
    tool = MCPTool(server, mcp_types.Tool(name="lookup", input_schema={"type": "object"}))
    async with Harness(Agent(instructions="x", tools=[tool]), [call("lookup")]) as h:
        await h.session.input("hello?")
        done = await h.wait_for("tool.ended", timeout=15)  # bound: the call's timeout and the grace to close
        assert done.data["status"] == "failed", done.data
        assert done.data["output"] == f"MCP server {hanging_server}: no answer within 1 s."


async def test_an_agents_own_tool_keeps_its_name_over_a_servers_tool(http_server, caplog):
    url, log, _ = http_server

    class Shop(Agent):
        @function_tool
        async def lookup(self, order_id: str) -> str:
            """The agent's own lookup."""
            return "own lookup"

    agent = Shop(instructions="x", mcp_servers=[MCPServerHTTP(url, name="warehouse")])
    with caplog.at_level(logging.WARNING, logger="switchboard.runtime.agent"):
        async with Harness(agent, [call("lookup", {"order_id": "A-1"})]) as h:
            await h.session.input("where")
            done = await ended(h)
            assert done.data["output"] == "own lookup"
            assert "slow" in h.session.model_tools()
    assert "called lookup A-1" not in log.lines()
    assert "tool 'lookup' of MCP server warehouse is left out: the agent has a tool of that name" in caplog.text


async def test_a_stdio_server_runs_a_call_and_closing_the_session_cancels_the_running_one_and_reaps_it(tmp_path):
    log = ServerLog(tmp_path / "stdio.log")
    server = MCPServerStdio(
        [sys.executable, SERVER_SCRIPT, "stdio", str(log.path)],
        timeout_s=60,
        tools=["lookup", "slow"],
        policies={"slow": {"allow_cancellation": True}},
    )
    agent = Agent(instructions="x", mcp_servers=[server])
    async with Harness(agent, [call("lookup", {"order_id": "B-2"})]) as h:
        assert {"lookup", "slow"} <= set(h.session.model_tools())
        assert "huge" not in h.session.model_tools()  # not in the allow-list
        await h.session.input("where is my order")
        done = await ended(h)
        assert (done.data["status"], done.data["output"]) == ("completed", "order B-2: shipped")
        await h.idle()
        h.llm.turns.append(Turn(**call("slow", call_id="c2")))  # the next reply's (the others say "OK.")
        await h.session.input("and something slow")
        await log.shows("called slow")
        assert server_children(), "the server of the running call"
    # closed: the running call was cancelled, its server told and stopped
    assert h.store.tool_calls[h.sid]["c2"].status is ToolStatus.CANCELLED
    await log.shows("cancelled slow")
    await until(lambda: not server_children())
    h.check_invariants()


def test_a_policy_cannot_resume_an_mcp_call():
    with pytest.raises(ValueError, match="cannot resume"):
        MCPServer(name="x", policies={"t": {"on_restart": "resume"}})


# -- the agents file ----------------------------------------------------------------------------------------------


def agents_file(tmp_path: Path, servers: list[dict[str, Any]]) -> Path:
    path = tmp_path / "agents.json"
    path.write_text(json.dumps([{"name": "shop", "instructions": "Use the tools.", "mcp_servers": servers}]))
    return path


async def test_an_agents_file_agent_takes_the_tools_of_its_servers_with_headers_from_the_environment(
    http_server, tmp_path
):
    url, log, _ = http_server
    server = {
        "name": "warehouse",
        "url": url,
        "headers_env": {"Authorization": "WAREHOUSE_AUTH"},
        "tools": ["lookup"],
        "prefix": "wh_",
        "policies": {"lookup": {"on_duplicate": "reject", "timeout_s": 5}},
    }
    declared = load_agents_file(
        agents_file(tmp_path, [server]), Webhooks(), environ={"WAREHOUSE_AUTH": "Bearer from-the-environment"}
    )
    registry = AgentRegistry()
    declared.register(registry)
    agent = registry.create("shop")
    (mcp_server,) = agent.mcp_servers
    assert isinstance(mcp_server, MCPServerHTTP)
    assert mcp_server.headers == {"Authorization": "Bearer from-the-environment"}
    async with Harness(agent, [call("wh_lookup", {"order_id": "C-3"})]) as h:
        assert set(h.session.model_tools()) == {"wh_lookup"}
        tool = h.session.model_tools()["wh_lookup"]
        assert isinstance(tool, MCPTool) and tool.policy.on_duplicate == "reject" and tool.timeout_s == 5
        await h.session.input("where")
        done = await ended(h)
        assert done.data["output"] == "order C-3: shipped", done.data
    assert "called lookup C-3" in log.lines()
    assert registry.create("shop").mcp_servers[0] is mcp_server  # one server (and tool list) for every session


@pytest.mark.parametrize(
    ("server", "problem"),
    [
        ({"url": "http://127.0.0.1:9/mcp", "command": ["x"]}, "give either url (streamable HTTP) or command (stdio)"),
        ({}, "give either url (streamable HTTP) or command (stdio)"),
        ({"url": "http://127.0.0.1:9/mcp", "headers_env": {"Authorization": "UNSET_VAR"}}, "UNSET_VAR is not set"),
        ({"command": ["srv"], "headers_env": {"X": "SET_VAR"}}, "headers_env is for a url"),
        ({"command": ["srv"], "env_from": {"TOKEN": "lower case"}}, "is not an environment variable name"),
        ({"command": ["srv"], "policies": {"t": {"on_restart": "resume"}}}, "cannot resume"),
        ({"command": ["srv"], "timeout_s": 0}, "greater than 0"),
        ({"command": ["srv"], "tools_ttl_s": 0}, "greater than or equal to 1"),
        ({"command": ["srv"], "headers": {"Authorization": "literal"}}, "Extra inputs are not permitted"),
    ],
)
def test_an_agents_file_with_a_bad_mcp_server_is_refused_naming_the_field(tmp_path, server, problem):
    with pytest.raises(AgentsFileError) as err:
        read_agents_file(agents_file(tmp_path, [server]), environ={"SET_VAR": "v"})
    assert "shop.mcp_servers[0]" in str(err.value) or "agents[0].mcp_servers[0]" in str(err.value), str(err.value)
    assert problem in str(err.value)


# -- restarts -----------------------------------------------------------------------------------------------------


async def recovered(first: Harness, agent: Agent) -> Harness:
    """The session of ``first`` rebuilt from its store alone and recovered, as a new process would."""
    store, events, sid = first.store, first.events, first.sid
    h = Harness(agent)
    h.store, h.events = store, events
    h.session = AgentSession(
        session_id=sid,
        agent=agent,
        llm=h.llm,
        playout=SimulatedPlayout(WPS),
        store=store,
        events=events,
        options=SessionOptions(trust_model_call_ids=True, tool_cancel_grace_s=0.2),
        items=store.chat(sid),
        last_seq=events.events[sid][-1].seq,
    )
    await recover(
        h.session,
        tool_calls=list(store.tool_calls[sid].values()),
        speeches=list(store.speeches[sid].values()),
        reported=Reported.of(events.events[sid]),
    )
    return h


@pytest.mark.parametrize("on_restart", ["fail", "retry"])
async def test_a_call_running_when_its_process_stops_ends_interrupted_or_is_called_again(http_server, on_restart):
    url, log, _ = http_server

    def agent() -> Agent:  # each process builds its own server object: nothing is listed yet when it recovers
        policy = {"allow_cancellation": True, "on_restart": on_restart}
        return Agent(instructions="x", mcp_servers=[MCPServerHTTP(url, policies={"slow": policy})])

    first = Harness(agent(), [call("slow")])
    await first.session.start()
    await first.session.input("take your time")
    await log.shows("called slow")
    await first.session.suspend(tool_grace=False)  # the process stops: nothing more is written from it
    h = await recovered(first, agent())
    try:
        recovered_ev = h.of_type("session.recovered")[-1].data
        if on_restart == "fail":
            assert recovered_ev["interrupted_calls"] == ["c1"]
            assert h.store.tool_calls[h.sid]["c1"].status is ToolStatus.INTERRUPTED
        else:
            assert recovered_ev["retried_calls"] == ["c1"]
            await until(lambda: log.lines().count("called slow") == 2)
    finally:
        await h.session.aclose()
    assert h.store.tool_calls[h.sid]["c1"].ended
    h.check_invariants()


async def test_a_handoff_to_an_agent_with_mcp_servers_lists_its_servers_before_the_model_sees_its_tools(http_server):
    url, log, _ = http_server

    class Front(Agent):
        @function_tool
        async def transfer(self) -> Agent:
            """Hand the caller to the warehouse."""
            return Agent(instructions="Use the warehouse.", name="warehouse", mcp_servers=[MCPServerHTTP(url)])

    async with Harness(Front(instructions="Route."), [call("transfer")]) as h:
        assert "lookup" not in h.session.model_tools()
        await h.session.input("the warehouse please")
        await until(lambda: h.session.agent.name == "warehouse")
        assert "lookup" in h.session.model_tools()
        await h.idle()
        h.llm.turns.append(Turn(**call("lookup", {"order_id": "E-5"}, call_id="c2")))
        await h.session.input("where is my order")
        done = await ended(h, "c2")
        assert done.data["output"] == "order E-5: shipped", done.data
    assert "called lookup E-5" in log.lines()


def test_a_server_is_named_by_its_url_without_the_credentials_it_may_carry():
    assert MCPServerHTTP("https://user:pw@crm.example:8443/mcp?token=t#x").name == "https://crm.example:8443/mcp"
    assert MCPServerHTTP("https://crm.example/mcp", name="crm").name == "crm"


async def test_a_session_closed_while_its_servers_are_listed_never_starts(hanging_server):
    h = Harness(Agent(instructions="x", mcp_servers=[MCPServerHTTP(hanging_server, timeout_s=5.0)]))
    start = asyncio.create_task(h.session.start())
    await until(lambda: HELD)  # the listing is under way (and hangs)
    await h.session.aclose()
    await start
    assert h.session.state is SessionStatus.CLOSED
    assert "session.started" not in h.types()


# -- what a server cannot make of Switchboard ----------------------------------------------------------------------


@contextmanager
def counting_http_server() -> Iterator[tuple[str, list[str]]]:
    """A plain HTTP server (a thread of its own: it answers even when the event loop does not) that records every
    request and answers each with a schema: its URL and the paths asked for."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"type": "integer"}')

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/internal/admin", asked
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


async def test_a_tool_whose_schema_refers_outside_itself_or_to_nothing_is_left_out_and_nothing_is_fetched(
    tmp_path, caplog
):
    with (
        counting_http_server() as (internal, asked),
        running_http_server(tmp_path, env={"MCP_TEST_REF_URL": internal}) as (url, log, _),
    ):
        server = MCPServerHTTP(url, name="warehouse", timeout_s=20)
        with caplog.at_level(logging.WARNING, logger="switchboard.integrations.mcp"):
            agent = Agent(instructions="x", mcp_servers=[server])
            async with Harness(agent, [call("refers_out", {"a": 5})]) as h:
                tools = h.session.model_tools()
                assert "lookup" in tools
                assert "refers_out" not in tools and "refers_nowhere" not in tools
                await h.session.input("go")
                done = await ended(h)
                assert done.data["status"] == "failed", done.data  # a tool the agent does not have
        assert asked == []
        assert "called refers_out" not in log.lines()
    left_out = [r.getMessage() for r in caplog.records if "is left out" in r.getMessage()]
    assert len(left_out) == 2, left_out
    assert "tool 'refers_out' of MCP server warehouse is left out: its input schema refers outside" in left_out[0]
    assert "tool 'refers_nowhere' of MCP server warehouse is left out" in left_out[1]
    assert internal not in caplog.text


async def test_a_reference_that_does_not_resolve_when_arguments_are_checked_fails_the_call_not_the_reply():
    # resolves from the root (so the tool is kept), not from the property's own $id where it is followed
    schema = {
        "type": "object",
        "$defs": {"n": {"type": "integer"}},
        "properties": {"a": {"$id": "urn:example:a", "$ref": "#/$defs/n"}},
    }
    server = MCPServerHTTP(f"http://127.0.0.1:{free_port()}/mcp")
    tool = MCPTool(server, mcp_types.Tool(name="lookup", input_schema=schema))
    turns = [call("lookup", {"a": 1}), {"text": "That did not work."}]
    async with Harness(Agent(instructions="x", tools=[tool]), turns) as h:
        await h.session.input("hello?")
        done = await ended(h)
        assert done.data["status"] == "failed", done.data
        assert done.data["output"].startswith("Invalid arguments for lookup:"), done.data
        assert "does not resolve" in done.data["output"]
        await h.idle()
        assert "generation.failed" not in h.types()
        assert ("assistant", "That did not work.") in h.summary()


def test_a_servers_repr_shows_no_credentials():
    server = MCPServerHTTP("https://user:pw@crm.example:8443/mcp?token=t#x")
    assert repr(server) == "<MCPServerHTTP https://crm.example:8443/mcp>"


async def test_concurrent_refreshes_share_one_listing_and_a_cancelled_caller_leaves_it_to_the_others(
    hanging_server,
):
    server = MCPServerHTTP(hanging_server, timeout_s=1.0)
    first = asyncio.create_task(server.refresh())
    await until(lambda: HELD)  # the listing is under way (and hangs)
    first.cancel()
    async with asyncio.timeout(15):  # bound: the listing gives up after timeout_s and the grace to close
        await asyncio.gather(*(server.refresh() for _ in range(50)))
    assert first.cancelled()
    assert len(HELD) == 1  # one connection: one listing for all 51 callers
    await server.refresh()  # failed a moment ago: not asked again at once
    assert len(HELD) == 1
    assert list(server.tools()) == []


def test_a_tool_list_kept_less_than_a_second_is_refused():
    with pytest.raises(ValueError, match="tools_ttl_s must be at least 1 s"):
        MCPServerHTTP("http://127.0.0.1:9/mcp", tools_ttl_s=0)


async def test_a_server_flooding_progress_reaches_the_chat_a_bounded_number_of_times(http_server):
    url, _, _ = http_server
    server = MCPServerHTTP(url, timeout_s=60)
    async with Harness(Agent(instructions="x", mcp_servers=[server]), [call("chatty", {"count": 10_000})]) as h:
        await h.session.input("tell me everything")
        done = await ended(h)
        assert (done.data["status"], done.data["output"]) == ("completed", "chatty done"), done.data
        progress = h.of_type("tool.progress")
        assert 1 <= len(progress) <= MAX_PROGRESS_UPDATES
        assert progress[0].data["message"] == "step 1"
        await h.idle()
        outputs = [item for item in h.summary() if item[:2] == ("output", "chatty")]
        assert len(outputs) <= MAX_PROGRESS_UPDATES + 1  # each update's pair, and the result's
        assert outputs[-1][2] == "chatty done"
