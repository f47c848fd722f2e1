"""The scripted model is a test and demo facility: a script picks the tool calls a session makes, with their
arguments. The attack: with auth on, a ``sessions:write`` key creates a session on an agent with real tools and
scripts the calls itself (``refund {"amount": 999999}``). And a turn with a hundred calls runs a hundred tools."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from switchboard.api.app import create_app
from switchboard.control.settings import ApiKey
from switchboard.runtime.agent import AgentRegistry

from .conftest import make_settings
from .test_sessions_api import assert_problem, until

KEY = "writer-key-0123456789"
SCRIPT = {"provider": "scripted", "turns": [{"tool_calls": [{"name": "book", "arguments": {"what": "everything"}}]}]}


def _settings(tmp_path: Path, **kw: Any) -> Any:
    kw.setdefault("scripted_model", None)  # the service's own default, not the test suite's
    return make_settings(tmp_path, **kw)


async def _create(tmp_path: Path, registry: AgentRegistry, body: dict[str, Any], **kw: Any) -> httpx.Response:
    app = create_app(_settings(tmp_path, **kw), registry=registry)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client,
    ):
        return await client.post("/v1/sessions", json=body, headers={"Authorization": f"Bearer {KEY}"})


def _keys() -> list[ApiKey]:
    return [ApiKey(key=KEY, scopes=["sessions:write", "sessions:read"])]


async def test_with_auth_on_a_session_cannot_script_its_own_model(tmp_path: Path, registry: AgentRegistry) -> None:
    r = await _create(tmp_path, registry, {"agent": "tester", "llm": SCRIPT}, api_keys=_keys())
    problem = assert_problem(r, 422, "invalid_session_config")
    assert "SWITCHBOARD_SCRIPTED_MODEL=allow" in problem["detail"]


@pytest.mark.parametrize(
    ("kw", "body"),
    [
        ({"api_keys": _keys(), "scripted_model": "allow"}, {"agent": "tester", "llm": SCRIPT}),
        ({}, {"agent": "tester", "llm": SCRIPT}),  # auth off: local development, make run
        ({"api_keys": _keys()}, {"agent": "demo"}),  # an agent's own default script is server configuration
    ],
    ids=["allowed-by-the-server", "auth-off", "agent-default"],
)
async def test_scripts_the_server_allows(
    tmp_path: Path, registry: AgentRegistry, kw: dict[str, Any], body: dict[str, Any]
) -> None:
    r = await _create(tmp_path, registry, body, **kw)
    assert r.status_code == 201, r.text


async def test_auth_off_can_deny_scripts_too(tmp_path: Path, registry: AgentRegistry) -> None:
    r = await _create(tmp_path, registry, {"agent": "tester", "llm": SCRIPT}, scripted_model="deny")
    assert_problem(r, 422, "invalid_session_config")


async def test_tool_calls_past_the_cap_of_one_turn_are_not_run(tmp_path: Path, registry: AgentRegistry) -> None:
    calls = [{"name": "slow", "arguments": {"seconds": i / 100}} for i in range(10)]
    llm = {"provider": "scripted", "turns": [{"tool_calls": calls}, {"text": "done"}]}
    app = create_app(make_settings(tmp_path, max_tool_calls_per_turn=3), registry=registry)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client,
    ):
        assert (await client.post("/v1/sessions", json={"id": "s", "agent": "tester", "llm": llm})).status_code == 201
        r = await client.post("/v1/sessions/s/input", json={"text": "book it all"})
        speech = r.json()["speech_id"]

        async def done() -> bool:
            return (await client.get(f"/v1/sessions/s/speeches/{speech}")).json()["state"] == "done"

        await until(done)
        outputs = [i for i in (await client.get("/v1/sessions/s/chat")).json()["items"] if "output" in i]
    assert len(outputs) == 10  # every call has its output (I1)
    ran = [o for o in outputs if not o["is_error"]]
    assert sorted(o["output"] for o in ran) == ["slept 0.0", "slept 0.01", "slept 0.02"]
    refused = [o for o in outputs if o["is_error"]]
    assert all("too many tool calls in one turn (at most 3)" in o["output"] for o in refused)
