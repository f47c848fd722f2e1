"""An agent without a model, through the app: its sessions run the stand-in, which calls the tools a user writes as
calls and says the results, and tells anything else how to call them; listings name it; a restart keeps it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from switchboard.api.app import create_app
from switchboard.control.settings import Settings
from switchboard.runtime.agent import AgentRegistry
from switchboard.runtime.llm.stand_in import CONNECT_A_MODEL

from .conftest import make_settings
from .test_sessions_api import until


@asynccontextmanager
async def _client(settings: Settings, registry: AgentRegistry) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings, registry=registry)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client,
    ):
        yield client


async def _answer(client: httpx.AsyncClient, sid: str, text: str) -> str:
    """Send ``text`` and return what the agent said in the end."""
    r = await client.post(f"/v1/sessions/{sid}/input", json={"text": text})
    assert r.status_code == 202, r.text
    before = r.json()["item_id"]

    async def said() -> str | None:
        items = (await client.get(f"/v1/sessions/{sid}/chat")).json()["items"]
        after = [it for it in items[[it["id"] for it in items].index(before) :] if it.get("role") == "assistant"]
        running = (await client.get(f"/v1/sessions/{sid}/tool-calls", params={"status": "running"})).json()["items"]
        return after[-1]["text"] if after and not running else None

    return str(await until(said))


async def test_a_session_of_an_agent_without_a_model_calls_tools_and_says_how(
    tmp_path: Path, registry: AgentRegistry
) -> None:
    settings = make_settings(tmp_path)
    async with _client(settings, registry) as client:
        agents = {a["name"]: a for a in (await client.get("/v1/agents")).json()["items"]}
        assert agents["tester"]["model"]["provider"] == "stand-in"
        assert agents["demo"]["model"]["provider"] == "scripted"  # its own script, as before

        created = (await client.post("/v1/sessions", json={"id": "s1", "agent": "tester"})).json()
        assert created["model"] == {"provider": "stand-in", "model": None, "profile": None, "fallbacks": []}
        assert await _answer(client, "s1", 'book(what="a table for 2")') == "book: booked a table for 2"
        help_text = await _answer(client, "s1", "hello")
        assert help_text.startswith("No model is configured for this agent; call a tool by writing it")
        assert "book(what=...)" in help_text

        await client.post("/v1/sessions", json={"id": "s2", "agent": "other"})
        assert await _answer(client, "s2", "hello") == CONNECT_A_MODEL

        scripted: dict[str, Any] = {"id": "s3", "agent": "tester", "llm": {"provider": "scripted"}}
        assert (await client.post("/v1/sessions", json=scripted)).json()["model"]["provider"] == "scripted"
        assert await _answer(client, "s3", 'book(what="a table")') == "OK."

    async with _client(settings, registry) as client:  # the next process recovers the session from the store
        assert (await client.get("/v1/sessions/s1")).json()["model"]["provider"] == "stand-in"
        assert await _answer(client, "s1", 'book {"what": "a cab"}') == "book: booked a cab"


async def test_where_sessions_may_not_script_the_stand_in_runs_no_tool(tmp_path: Path, registry: AgentRegistry) -> None:
    async with _client(make_settings(tmp_path, scripted_model="deny"), registry) as client:
        await client.post("/v1/sessions", json={"id": "s1", "agent": "tester"})
        assert await _answer(client, "s1", 'book(what="a table")') == CONNECT_A_MODEL
        assert (await client.get("/v1/sessions/s1/tool-calls")).json()["items"] == []
