"""An agent that takes its tools from an MCP server, through the HTTP API: the agents list shows the server's tools,
a session's call runs on the server with its progress on the call's record, and a REST cancel stops it there."""

from __future__ import annotations

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
