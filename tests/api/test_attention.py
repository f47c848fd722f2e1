"""What needs an operator: each session's `attention` reasons, `GET /v1/sessions?attention=true`, and agents."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from switchboard.api.app import create_app
from switchboard.api.cluster.attention import merged
from switchboard.api.schemas import AttentionRead, SessionRead
from switchboard.control.attention import AttentionCode, AttentionReason
from switchboard.runtime.agent import AgentRegistry
from tests.waiting import until

from .conftest import Api, make_settings
from .test_sessions_api import assert_problem

SAME = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


async def reasons(api: Api, sid: str) -> list[dict[str, Any]]:
    return list((await api.client.get(f"/v1/sessions/{sid}")).json()["attention"])


async def codes(api: Api, sid: str) -> list[str]:
    return [r["code"] for r in await reasons(api, sid)]


async def queue(api: Api, **params: Any) -> list[str]:
    r = await api.client.get("/v1/sessions", params={"attention": "true", **params})
    assert r.status_code == 200, r.text
    return [s["id"] for s in r.json()["items"]]


async def test_a_failed_generation_needs_attention_until_the_model_answers_again(api: Api) -> None:
    s = await api.create(
        id="g1", llm={"provider": "scripted", "turns": [{"error": "upstream 502"}, {"text": "Back again."}]}
    )
    await api.create(id="calm")
    assert await codes(api, "g1") == [] and await queue(api) == []
    await api.client.post("/v1/sessions/g1/input", json={"text": "hello"})
    await until(lambda: codes(api, "g1"))
    [reason] = await reasons(api, "g1")
    assert reason["code"] == "generation_failed" and "upstream 502" in reason["message"] and reason["since"]
    assert await queue(api) == ["g1"]
    assert await queue(api, agent="tester") == ["g1"] and await queue(api, agent="other") == []
    await api.client.post("/v1/sessions/g1/input", json={"text": "again"})
    await until(lambda: _empty(api, "g1"))
    assert await queue(api) == []
    assert s["model"] == {"provider": "scripted", "model": None, "profile": None, "fallbacks": []}


async def _empty(api: Api, sid: str) -> bool:
    return await codes(api, sid) == []


async def test_a_failed_tool_needs_attention_until_the_same_tool_completes(api: Api) -> None:
    turns = [
        {"tool_calls": [{"name": "slow", "arguments": {"seconds": "a while"}}]},
        {"text": "Sorry."},
        {"tool_calls": [{"name": "book", "arguments": {"what": "x"}}]},
        {"text": "Booked."},
        {"tool_calls": [{"name": "slow", "arguments": {"seconds": 0.01}}]},
    ]
    await api.create(id="t1", llm={"provider": "scripted", "turns": turns})
    await api.client.post("/v1/sessions/t1/input", json={"text": "go"})
    await until(lambda: codes(api, "t1"))
    [reason] = await reasons(api, "t1")
    assert reason["code"] == "tool_failed" and reason["message"].startswith("slow failed: ")
    await api.client.post("/v1/sessions/t1/input", json={"text": "book"})
    await until(lambda: _spoke(api, "t1", "Booked."))
    assert await codes(api, "t1") == ["tool_failed"]  # another tool working says nothing about this one
    await api.client.post("/v1/sessions/t1/input", json={"text": "again"})
    await until(lambda: _empty(api, "t1"))


async def _spoke(api: Api, sid: str, text: str) -> bool:
    items = (await api.client.get(f"/v1/sessions/{sid}/chat")).json()["items"]
    return any(i.get("text") == text for i in items)


async def test_stalled_speech_long_tool_and_silence_are_read_from_the_live_session(
    tmp_path: Any, registry: AgentRegistry
):
    settings = make_settings(tmp_path, attention_stall_s=0.2, attention_silence_s=0.3, attention_long_tool_s=0.2)
    app = create_app(settings, registry=registry)
    async with app.router.lifespan_context(app):
        import httpx

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            api = Api(client, app)
            # a model that accepts and never answers (for a minute)
            await api.create(id="stall", llm={"provider": "scripted", "turns": [{"text": "late", "ttft_ms": 60000}]})
            await client.post("/v1/sessions/stall/input", json={"text": "hello?"})
            await until(lambda: _has(api, "stall", {"speech_stalled", "silence_after_input"}))
            messages = {r["code"]: r["message"] for r in await reasons(api, "stall")}
            assert messages["speech_stalled"].startswith("no answer from the model for ")
            # a tool running for longer than the threshold
            turns = [{"text": "Searching.", "tool_calls": [{"name": "search", "arguments": {"query": "q"}}]}]
            await api.create(id="long", llm={"provider": "scripted", "turns": turns})
            await client.post("/v1/sessions/long/input", json={"text": "search"})

            # it spoke ("Searching."): once that is heard, only the tool is a reason (on a loaded machine the speech
            # can take longer than the 0.3 s of silence allowed, and the session is then silent for a moment)
            async def only_the_tool() -> bool:
                return await codes(api, "long") == ["tool_long_running"]

            await until(only_the_tool)
            assert set(await queue(api)) == {"stall", "long"}
            await client.post("/v1/sessions/stall/interrupt", json={"force": True})
            await client.delete("/v1/sessions/long")
            assert await codes(api, "long") == []


async def _has(api: Api, sid: str, wanted: set[str]) -> bool:
    return wanted <= set(await codes(api, sid))


async def test_list_by_agent_and_bad_filters(api: Api) -> None:
    await api.create(id="a1")
    await api.create(id="b1", agent="other")
    ids = [s["id"] for s in (await api.client.get("/v1/sessions", params={"agent": "other"})).json()["items"]]
    assert ids == ["b1"]
    assert (await api.client.get("/v1/sessions", params={"agent": "nobody"})).json()["items"] == []
    assert_problem(await api.client.get("/v1/sessions", params={"state": "bogus"}), 422, "invalid_request")
    listed = (await api.client.get("/v1/sessions")).json()["items"]
    assert all(s["last_activity_at"] >= s["created_at"] for s in listed)


async def test_agents_are_listed_with_tools_schemas_policies_and_model_names(api: Api) -> None:
    r = await api.client.get("/v1/agents")
    assert r.status_code == 200
    agents = {a["name"]: a for a in r.json()["items"]}
    assert {"demo", "tester", "other"} <= set(agents)
    tools = {t["name"]: t for t in agents["tester"]["tools"]}
    assert tools["book"]["description"] == "Book something at once."
    assert tools["book"]["parameters"]["properties"]["what"]["type"] == "string"
    assert tools["book"]["policy"]["on_duplicate"] == "reject"
    assert tools["search"]["policy"]["allow_cancellation"] is True
    assert agents["demo"]["model"]["provider"] == "scripted"
    # an agent class without a docstring of its own has no description (it got the framework's own docstring)
    assert agents["other"]["description"] is None
    assert agents["demo"]["description"] and "Subclass" not in agents["demo"]["description"]
    one = await api.client.get("/v1/agents/tester")
    assert one.status_code == 200 and one.json() == agents["tester"]
    assert_problem(await api.client.get("/v1/agents/nobody"), 404, "agent_not_found")


async def test_agents_show_profile_names_never_endpoints_or_variables(
    tmp_path: Any, registry: AgentRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    import httpx

    monkeypatch.setenv("SECRET_VAR", "sk-secret-value-0123456789")
    models = {
        "fast": {
            "provider": "openai",
            "model": "m-1",
            "base_url": "http://10.0.0.9:8000/v1",
            "api_key_env": "SECRET_VAR",
        }
    }
    app = create_app(make_settings(tmp_path, models=models), registry=registry)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            s = await client.post("/v1/sessions", json={"agent": "tester", "llm": {"profile": "fast"}})
            assert s.status_code == 201, s.text
            assert s.json()["model"] == {"provider": "openai", "model": "m-1", "profile": "fast", "fallbacks": []}
            text = (await client.get("/v1/agents")).text + s.text + (await client.get("/v1/sessions")).text
            assert "10.0.0.9" not in text and "SECRET_VAR" not in text and "sk-secret" not in text


@pytest.mark.parametrize("path", ["/v1/agents", "/v1/agents/tester"])
async def test_agents_need_a_key_with_sessions_read(tmp_path: Any, registry: AgentRegistry, path: str) -> None:
    import httpx

    keys = [{"key": "k" * 24, "scopes": ["sessions:write"]}]
    app = create_app(make_settings(tmp_path, api_keys=keys), registry=registry)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            assert (await client.get(path)).status_code == 401
            r = await client.get(path, headers={"Authorization": "Bearer " + "k" * 24})
            assert r.status_code == 403


async def test_a_session_that_failed_on_recovery_is_in_the_queue_with_its_reason(tmp_path: Any) -> None:
    import httpx

    from switchboard.integrations.demo import AGENTS as DEMO_AGENTS
    from tests.agents_fixture import AGENTS, RETIRED_AGENTS

    settings = make_settings(tmp_path)
    first = create_app(settings, registry=AgentRegistry({**DEMO_AGENTS, **AGENTS, **RETIRED_AGENTS}))
    async with first.router.lifespan_context(first):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=first), base_url="http://test") as client:
            assert (await client.post("/v1/sessions", json={"id": "old", "agent": "retired"})).status_code == 201
    second = create_app(settings, registry=AgentRegistry({**DEMO_AGENTS, **AGENTS}))
    async with second.router.lifespan_context(second):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=second), base_url="http://test") as client:
            api = Api(client, second)
            assert await queue(api) == ["old"]
            [reason] = await reasons(api, "old")
            assert reason["code"] == "session_failed" and "unknown agent 'retired'" in reason["message"]
            assert (await client.get("/v1/sessions/old")).json()["state"] == "failed"


async def test_a_handoff_to_an_unregistered_agent_is_warned_about_once(tmp_path: Any, caplog: pytest.LogCaptureFixture):
    import httpx

    from tests.agents_fixture import Other, Tester

    AgentRegistry({"other": Other})  # names the class "other", as a registry that knows it would
    app = create_app(make_settings(tmp_path), registry=AgentRegistry({"tester": Tester}))
    turns = [{"text": "Transferring.", "tool_calls": [{"name": "transfer", "arguments": {}}]}]
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            for sid in ("h1", "h2"):
                body = {"id": sid, "agent": "tester", "llm": {"provider": "scripted", "turns": turns}}
                assert (await client.post("/v1/sessions", json=body)).status_code == 201
                await client.post(f"/v1/sessions/{sid}/input", json={"text": "transfer me"})

                async def handed_off(sid: str = sid) -> bool:
                    return (await client.get(f"/v1/sessions/{sid}")).json()["agent"] == "other"

                await until(handed_off)
    warnings = [r for r in caplog.records if "which is not registered" in r.getMessage()]
    assert len(warnings) == 1 and "'other'" in warnings[0].getMessage() and warnings[0].levelname == "WARNING"


async def test_model_fallbacks_metrics_and_latency_through_the_api(tmp_path: Any, registry: AgentRegistry) -> None:
    import httpx

    down = {"provider": "scripted", "turns": [{"error": "upstream 503"}] * 3}
    models = {
        "main": {**down, "fallbacks": ["spare"]},
        "spare": {"provider": "scripted", "turns": [{"text": "Spare model here.", "ttft_ms": 30}]},
        "alone": down,
    }
    agents = tmp_path / "agents.yaml"
    agents.write_text(
        "- name: desk\n  instructions: Help.\n  llm: {profile: alone}\n"
        "  on_model_error: Sorry, I cannot answer right now. Someone will call you back.\n"
    )
    app = create_app(make_settings(tmp_path, models=models, agents_file=agents), registry=registry)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            api = Api(client, app)
            s = await api.create(id="fb", llm={"profile": "main"})
            assert s["model"] == {"provider": "scripted", "model": None, "profile": "main", "fallbacks": ["spare"]}
            await client.post("/v1/sessions/fb/input", json={"text": "hello"})
            await until(lambda: _spoke(api, "fb", "Spare model here."))
            latency = (await client.get("/v1/sessions/fb")).json()["latency"]
            assert latency["time_to_first_token_ms"] >= 25 and latency["time_to_first_audio_ms"] >= 25
            assert await codes(api, "fb") == []  # the fallback answered: nothing failed for the caller

            desk = await api.create(id="desk", agent="desk")
            assert desk["model"]["profile"] == "alone"
            await client.post("/v1/sessions/desk/input", json={"text": "hello"})
            await until(lambda: _spoke(api, "desk", "Sorry, I cannot answer right now. Someone will call you back."))
            assert await codes(api, "desk") == ["generation_failed"]  # heard an apology, still needs a person

            metrics = (await client.get("/metrics")).text
            assert 'switchboard_generation_failures_total{model="scripted"} 1.0' in metrics
            assert 'switchboard_model_time_to_first_token_seconds_count{model="scripted"}' in metrics
            assert 'switchboard_model_tokens_total{kind="completion",model="scripted"}' in metrics


async def test_sessions_waiting_since_the_same_instant_are_listed_in_one_order(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reasons that began at the same instant (the clock's resolution, or one fault hitting many sessions) used to
    be listed in whatever order the sessions happened to be held, so ``limit`` cut the list differently from one
    read, or one node, to the next: ties go by session id."""
    host = api.app.state.services.host
    reason = AttentionReason(code=AttentionCode.GENERATION_FAILED, message="the model failed", since=SAME)
    monkeypatch.setattr(host, "attention_reasons", lambda view: [reason])
    for sid in ("sess-c", "sess-a", "sess-b"):
        await api.create(id=sid, llm={"provider": "scripted", "turns": []})
    assert await queue(api) == ["sess-a", "sess-b", "sess-c"]
    assert await queue(api, limit=2) == ["sess-a", "sess-b"]


def test_the_clusters_attention_list_orders_ties_by_session_id_whichever_node_answered_first() -> None:
    def waiting(sid: str, node: str) -> SessionRead:
        reason = AttentionRead(code=AttentionCode.GENERATION_FAILED, message="the model failed", since=SAME)
        now = SAME + timedelta(seconds=5)
        return SessionRead(
            id=sid,
            agent="tester",
            state="active",
            agent_state="listening",
            current_speech_id=None,
            created_at=SAME,
            metadata={},
            owner_node=node,
            last_activity_at=now,
            attention=[reason],
        )

    here, there = [waiting("sess-b", "node-a")], [waiting("sess-a", "node-b"), waiting("sess-c", "node-b")]
    assert [s.id for s in merged(here, there)] == ["sess-a", "sess-b", "sess-c"]
    assert [s.id for s in merged(there, here)] == ["sess-a", "sess-b", "sess-c"]


async def test_the_built_in_agents_can_be_turned_off(tmp_path: Any) -> None:
    import httpx

    settings = make_settings(tmp_path, agents="tests.agents_fixture:AGENTS", demo_agents=False)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            names = {a["name"] for a in (await client.get("/v1/agents")).json()["items"]}
            assert names == {"tester", "other"}  # no demo, no billing
            r = await client.post("/v1/sessions", json={"agent": "demo"})
            assert r.status_code in (404, 422) and "demo" in r.text, r.text
