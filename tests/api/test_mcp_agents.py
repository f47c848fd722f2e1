"""An agent that takes its tools from an MCP server, through the HTTP API: the agents list shows the server's tools,
a session's call runs on the server with its progress on the call's record, and a REST cancel stops it there."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from switchboard import Agent
from switchboard.api.app import create_app
from switchboard.integrations.mcp_tools import MCPServerHTTP
from switchboard.runtime.agent import AgentRegistry
from tests.mcp_support import ServerLog, running_http_server
from tests.waiting import until

from .conftest import make_settings

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def shop(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, ServerLog]]:
    with running_http_server(tmp_path) as (url, log, _):
        server = MCPServerHTTP(url, name="warehouse", policies={"slow": {"allow_cancellation": True}})

        class Shop(Agent):
            """Sells things."""

            def __init__(self) -> None:
                super().__init__(instructions="Use the warehouse.", mcp_servers=[server])

        app = create_app(make_settings(tmp_path), registry=AgentRegistry({"shop": Shop}))
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
                yield client, log


def script(*tool_calls: dict[str, Any]) -> dict[str, Any]:
    return {"provider": "scripted", "turns": [{"text": "One moment.", "tool_calls": list(tool_calls)}]}


async def call_of(client: httpx.AsyncClient, sid: str, status: str) -> dict[str, Any]:
    async def ended() -> dict[str, Any] | None:
        items = (await client.get(f"/v1/sessions/{sid}/tool-calls")).json()["items"]
        return next((c for c in items if c["status"] == status), None)

    found: dict[str, Any] = await until(ended)
    return found


async def test_the_agents_list_shows_the_servers_tools_and_a_call_runs_there_with_its_progress(shop) -> None:
    client, log = shop
    described = (await client.get("/v1/agents/shop")).json()
    tools = {t["name"]: t for t in described["tools"]}
    assert {"lookup", "slow", "broken"} <= set(tools)
    assert tools["slow"]["policy"]["allow_cancellation"] is True
    assert tools["lookup"]["parameters"]["properties"]["order_id"]["type"] == "string"

    created = await client.post(
        "/v1/sessions", json={"agent": "shop", "llm": script({"name": "lookup", "arguments": {"order_id": "D-4"}})}
    )
    sid = created.json()["id"]
    await client.post(f"/v1/sessions/{sid}/input", json={"text": "where is my order"})
    done = await call_of(client, sid, "completed")
    assert done["output"] == "order D-4: shipped"
    assert [p["message"] for p in done["progress"]] == ["looking in the warehouse", "2 of 2"]
    assert "called lookup D-4" in log.lines()
    assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 204


async def test_a_rest_cancel_stops_the_call_on_the_server(shop) -> None:
    client, log = shop
    created = await client.post("/v1/sessions", json={"agent": "shop", "llm": script({"name": "slow"})})
    sid = created.json()["id"]
    await client.post(f"/v1/sessions/{sid}/input", json={"text": "take your time"})
    await log.shows("called slow")
    running = await call_of(client, sid, "running")
    r = await client.post(f"/v1/sessions/{sid}/tool-calls/{running['call_id']}/cancel")
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "cancelled"
    await log.shows("cancelled slow")
    assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 204


class Silent:
    """A server that accepts connections and never answers; ``peak`` is the most connections it held open at once."""

    def __init__(self) -> None:
        self.open = 0
        self.peak = 0
        self.url = ""
        self.held: list[asyncio.StreamWriter] = []

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.held.append(writer)
        self.open += 1
        self.peak = max(self.peak, self.open)
        try:
            while await reader.read(65536):  # until the client closes it
                pass
        finally:
            self.open -= 1
            writer.close()


@pytest.fixture
async def silent() -> AsyncIterator[Silent]:
    found = Silent()
    server = await asyncio.start_server(found.accept, "127.0.0.1", 0)
    found.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/mcp"
    try:
        yield found
    finally:
        for writer in found.held:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_a_create_cut_off_while_the_servers_are_listed_still_leaves_an_active_session(tmp_path, silent) -> None:
    server = MCPServerHTTP(silent.url, name="silent", timeout_s=3.0)

    class Shop(Agent):
        def __init__(self) -> None:
            super().__init__(instructions="x", mcp_servers=[server])

    settings = make_settings(tmp_path, request_timeout_s=1.0)  # the listing outlasts the create's deadline
    app = create_app(settings, registry=AgentRegistry({"shop": Shop}))
    body = {"id": "s1", "agent": "shop", "llm": {"provider": "scripted", "turns": [{"text": "Hello."}]}}
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            created = await client.post("/v1/sessions", json=body)
            assert created.status_code in (201, 503, 504), created.text

            async def state() -> bool:
                return (await client.get("/v1/sessions/s1")).json()["state"] == "active"

            await until(state)
            again = await client.post("/v1/sessions", json=body)
            assert again.status_code == 200 and again.json()["state"] == "active", again.text
            answered = await client.post("/v1/sessions/s1/input", json={"text": "hi"})
            assert answered.status_code < 300, answered.text
            assert (await client.delete("/v1/sessions/s1")).status_code == 204


async def test_the_agents_list_lists_the_servers_of_its_agents_at_once(tmp_path, silent) -> None:
    def agent_of(server: MCPServerHTTP) -> type[Agent]:
        class Shop(Agent):
            def __init__(self) -> None:
                super().__init__(instructions="x", mcp_servers=[server])

        return Shop

    servers = [MCPServerHTTP(silent.url, name=f"silent-{n}", timeout_s=1.0) for n in range(2)]
    registry = AgentRegistry({f"shop{n}": agent_of(server) for n, server in enumerate(servers)})
    app = create_app(make_settings(tmp_path), registry=registry)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            listed = await client.get("/v1/agents")
            assert listed.status_code == 200, listed.text
            assert sorted(a["name"] for a in listed.json()["items"]) == ["shop0", "shop1"]
    assert silent.peak == 2  # both servers were asked at once, not one after the other's timeout
