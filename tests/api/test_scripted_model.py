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


async def _session_of(client: httpx.AsyncClient, sid: str, turns: list[dict[str, Any]], text: str) -> list[Any]:
    """Run one input on a new scripted session ``sid``; its chat once the reply is done."""
    llm = {"provider": "scripted", "turns": turns}
    assert (await client.post("/v1/sessions", json={"id": sid, "agent": "tester", "llm": llm})).status_code == 201
    speech = (await client.post(f"/v1/sessions/{sid}/input", json={"text": text})).json()["speech_id"]

    async def done() -> bool:
        return (await client.get(f"/v1/sessions/{sid}/speeches/{speech}")).json()["state"] == "done"

    await until(done)
    return list((await client.get(f"/v1/sessions/{sid}/chat")).json()["items"])


async def test_tool_calls_past_the_cap_of_one_session_are_rejected(tmp_path: Path, registry: AgentRegistry) -> None:
    """One input with many calls and max_tool_steps: 20 gave 1,500 tool runs: per turn caps alone do not bound a
    session. Past the session's cap every call ends `rejected`, with an output that says why, and never runs."""
    two = {"tool_calls": [{"name": "slow", "arguments": {"seconds": 0}} for _ in range(2)]}
    app = create_app(make_settings(tmp_path, max_tool_calls_per_session=3), registry=registry)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client,
    ):
        chat = await _session_of(client, "s", [two, two, two, {"text": "done"}], "go")
        calls = (await client.get("/v1/sessions/s/tool-calls")).json()["items"]
    assert [c["status"] for c in calls] == ["completed"] * 3 + ["rejected"] * 3
    for call in calls[3:]:
        assert (
            call["is_error"] and call["output"] == "this session made its 3 tool calls, the most it may make; not run"
        )
    outputs = [i for i in chat if i["type"] == "function_call_output"]
    assert len(outputs) == 6  # each call still has its output (I1, I5)


async def test_call_ids_are_the_services_own(tmp_path: Path, registry: AgentRegistry) -> None:
    """A script picked its calls' ids: the same id in two sessions, or one shaped like another call's synthetic
    `<id>/final` pair. Now the service names every call; what the script says is ignored."""
    turn = {
        "tool_calls": [
            {"name": "book", "arguments": {"what": "a"}, "id": "victim"},
            {"name": "book", "arguments": {"what": "b"}, "id": "victim/final"},
        ]
    }
    app = create_app(make_settings(tmp_path), registry=registry)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client,
    ):
        await _session_of(client, "a", [turn, {"text": "done"}], "go")
        await _session_of(client, "b", [turn, {"text": "done"}], "go")
        ids = [
            c["call_id"] for sid in "ab" for c in (await client.get(f"/v1/sessions/{sid}/tool-calls")).json()["items"]
        ]
    assert len(ids) == 4 and len(set(ids)) == 4
    assert all(i.startswith("call_") and "victim" not in i and "/" not in i for i in ids), ids


async def test_the_session_cap_counts_the_calls_made_before_a_restart(tmp_path: Path, registry: AgentRegistry) -> None:
    two = {"tool_calls": [{"name": "slow", "arguments": {"seconds": 0}} for _ in range(2)]}
    turns = [two, {"text": "first done"}, two, {"text": "second done"}]
    settings = make_settings(tmp_path, max_tool_calls_per_session=3)
    app = create_app(settings, registry=registry)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client,
    ):
        await _session_of(client, "s", turns, "go")
    app = create_app(settings, registry=registry)  # the next process: the session is recovered from the store
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client,
    ):
        speech = (await client.post("/v1/sessions/s/input", json={"text": "again"})).json()["speech_id"]

        async def done() -> bool:
            return (await client.get(f"/v1/sessions/s/speeches/{speech}")).json()["state"] == "done"

        await until(done)
        calls = (await client.get("/v1/sessions/s/tool-calls")).json()["items"]
    assert [c["status"] for c in calls] == ["completed"] * 3 + ["rejected"]


def test_the_spec_documents_the_turn_format_with_an_example(tmp_path: Path, registry: AgentRegistry) -> None:
    spec = create_app(make_settings(tmp_path), registry=registry).openapi()
    llm = spec["components"]["schemas"]["SessionCreate"]["properties"]["llm"]
    script = next(s for s in llm["anyOf"] if s.get("title") == "Scripted model")
    turn = script["properties"]["turns"]["items"]
    assert {"text", "tool_calls", "ttft_ms", "word_ms"} <= set(turn["properties"])
    assert "{{tool_output:NAME}}" in turn["properties"]["text"]["description"]
    assert set(script["properties"]["fallback"]["properties"]) == set(turn["properties"])
    assert any("turns" in example for example in llm["examples"])
    assert any("profile" in s.get("properties", {}) for s in llm["anyOf"])


@pytest.mark.parametrize(
    ("llm", "said"),
    [
        ({"provider": "scripted", "turns": [{"txt": "hi"}]}, "unknown key 'turns.0.txt'"),
        ({"provider": "scripted", "turns": "hi"}, "turns: Input should be a valid list"),
        ({"provider": "scripted", "turn": []}, "unknown key 'turn' (allowed: provider, turns, fallback, on_user"),
        ({"provider": "scripted", "turns": [{"ttft_ms": -1}]}, "turns.0.ttft_ms: Input should be greater than"),
    ],
)
async def test_a_bad_script_is_refused_in_words_without_a_validation_dump(
    tmp_path: Path, registry: AgentRegistry, llm: dict[str, Any], said: str
) -> None:
    r = await _create(tmp_path, registry, {"agent": "tester", "llm": llm}, scripted_model="allow")
    problem = assert_problem(r, 422, "invalid_session_config")
    assert said in problem["detail"]
    assert "pydantic" not in r.text and "http" not in problem["detail"] and "input_value" not in r.text
