"""Scheduled commands (`when` on input, say and interrupt) and coaching notes over HTTP, on SQLite and PostgreSQL:
accepted durably (202), applied once at their point, listed, cancelled, idempotent, capped, cancelled by a close, and
kept across a restart of the service."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from switchboard.api.app import create_app
from switchboard.control.settings import Settings
from switchboard.runtime import scheduled as scheduled_module
from switchboard.runtime.agent import AgentRegistry
from tests.e2e.test_faults import PG_URL, pg_database
from tests.waiting import until

from .conftest import Api, make_settings
from .test_sessions_api import assert_problem

# a speech that outlasts the requests a test sends while it plays, however loaded the machine (60 s at 100 words a
# second); a test that needs it over interrupts it, or closes the session
LONG = " ".join(f"word{i}" for i in range(6000))


class _api:
    def __init__(self, settings: Any, registry: AgentRegistry) -> None:
        self.app = create_app(settings, registry=registry)
        self._lifespan = self.app.router.lifespan_context(self.app)
        self._client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://test")

    async def __aenter__(self) -> Api:
        await self._lifespan.__aenter__()
        await self._client.__aenter__()
        return Api(self._client, self.app)

    async def __aexit__(self, *exc: Any) -> None:
        await self._client.__aexit__(*exc)
        await self._lifespan.__aexit__(*exc)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
async def settings(request: pytest.FixtureRequest, tmp_path: Any) -> AsyncIterator[Any]:
    """Settings on a SQLite file, or on a PostgreSQL database of its own (the same for every app a test starts)."""
    if request.param == "sqlite":
        yield make_settings(tmp_path)
        return
    async with pg_database() as name:
        url = make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
        yield make_settings(tmp_path, database_url=url)


@pytest.fixture
async def api(settings: Any, registry: AgentRegistry) -> AsyncIterator[Api]:
    async with _api(settings, registry) as api:
        yield api


async def chat_texts(api: Api, sid: str, role: str) -> list[str]:
    r = await api.client.get(f"/v1/sessions/{sid}/chat")
    return [it["text"] for it in r.json()["items"] if it["type"] == "message" and it["role"] == role]


async def scheduled(api: Api, sid: str, command_id: str) -> dict[str, Any]:
    r = await api.client.get(f"/v1/sessions/{sid}/scheduled/{command_id}")
    assert r.status_code == 200, r.text
    return dict(r.json())


async def applied(api: Api, sid: str, command_id: str) -> dict[str, Any]:
    async def done() -> dict[str, Any] | None:
        found = await scheduled(api, sid, command_id)
        return found if found["state"] != "pending" else None

    found: dict[str, Any] = await until(done, every_s=0.05)
    assert found["state"] == "applied", found
    return found


async def event_types(api: Api, sid: str) -> list[dict[str, Any]]:
    r = await api.client.get(f"/v1/sessions/{sid}/export")
    return list(json.loads(r.content)["events"])


async def speaking(api: Api, sid: str) -> bool:
    r = await api.client.get(f"/v1/sessions/{sid}")
    return bool(r.json()["agent_state"] == "speaking")


async def test_input_when_idle_applies_after_the_speech_once(api: Api) -> None:
    await api.create(id="s1", llm={"provider": "scripted", "turns": [{"text": LONG}, {"text": "Sure."}]})
    c = api.client
    assert (await c.post("/v1/sessions/s1/input", json={"text": "talk"})).status_code == 202
    await until(lambda: speaking(api, "s1"))
    r = await c.post("/v1/sessions/s1/input", json={"text": "later", "when": {"at": "idle"}})
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["item_id"] is None and body["speech_id"] is None
    command = body["scheduled"]
    assert command["state"] == "pending" and command["kind"] == "input" and command["at"] == "idle"
    listed = (await c.get("/v1/sessions/s1/scheduled?pending_only=true")).json()["items"]
    assert [x["id"] for x in listed] == [command["id"]]
    assert await chat_texts(api, "s1", "user") == ["talk"]  # the speech plays on: the input waits
    stop = await c.post("/v1/sessions/s1/interrupt", json={})
    assert stop.status_code == 200 and stop.json()["interrupted"], stop.text
    done = await applied(api, "s1", command["id"])
    assert done["result"]["item_id"]
    assert await chat_texts(api, "s1", "user") == ["talk", "later"]
    events = await until(lambda: _with(api, "s1", "scheduled.applied"), every_s=0.05)
    types = [e["type"] for e in events]
    assert types.count("scheduled.created") == 1 and types.count("scheduled.applied") == 1
    trail = [e["data"] for e in events if e["type"] == "operator.action" and e["data"]["action"] == "schedule"]
    assert trail and trail[0]["scheduled_id"] == command["id"]


async def _with(api: Api, sid: str, type_: str) -> list[dict[str, Any]] | None:
    events = await event_types(api, sid)
    return events if any(e["type"] == type_ for e in events) else None


async def test_when_now_is_the_command_as_ever(api: Api) -> None:
    await api.create(id="s1", llm={"provider": "scripted", "turns": [{"text": "Hi."}]})
    r = await api.client.post("/v1/sessions/s1/input", json={"text": "hello", "when": {"at": "now"}})
    assert r.status_code == 202 and r.json()["item_id"] and "scheduled" not in r.json()


async def test_refusals(api: Api) -> None:
    await api.create(id="s1", llm={"provider": "scripted", "turns": [{"text": LONG}]})
    c = api.client
    bad = await c.post("/v1/sessions/s1/say", json={"text": "x", "when": {"at": "after_tool", "call_id": "nope"}})
    assert_problem(bad, 422, "unknown_tool_call")
    interim = await c.post("/v1/sessions/s1/input", json={"text": "x", "final": False, "when": {"at": "idle"}})
    assert interim.status_code == 422, interim.text
    unknown_point = await c.post("/v1/sessions/s1/say", json={"text": "x", "when": {"at": "soon"}})
    assert unknown_point.status_code == 422
    assert_problem(await c.delete("/v1/sessions/s1/scheduled/sched_nope"), 404, "scheduled_command_not_found")
    assert_problem(await c.get("/v1/sessions/s1/scheduled/sched_nope"), 404, "scheduled_command_not_found")
    assert_problem(await c.post("/v1/sessions/nope/coach", json={"note": "x"}), 404, "session_not_found")


async def test_after_tool_and_after_speech(api: Api) -> None:
    turns = [{"text": "Looking.", "tool_calls": [{"name": "slow", "arguments": {"seconds": 0.5}, "id": "c1"}]}]
    await api.create(id="s1", llm={"provider": "scripted", "turns": turns, "fallback": {"text": "Found."}})
    c = api.client
    await c.post("/v1/sessions/s1/input", json={"text": "look"})
    calls = await until(lambda: _calls(api, "s1"))
    call_id = calls[0]["call_id"]
    r = await c.post(
        "/v1/sessions/s1/say", json={"text": "It ended.", "when": {"at": "after_tool", "call_id": call_id}}
    )
    assert r.status_code == 202 and r.json()["speech_id"] is None, r.text
    done = await applied(api, "s1", r.json()["scheduled"]["id"])
    ended = (await c.get(f"/v1/sessions/s1/tool-calls/{call_id}")).json()
    assert ended["status"] == "completed" and done["ended_at"] >= ended["ended_at"]
    # the call has ended already: at once
    again = await c.post(
        "/v1/sessions/s1/say", json={"text": "Again.", "when": {"at": "after_tool", "call_id": call_id}}
    )
    await applied(api, "s1", again.json()["scheduled"]["id"])
    # nothing playing: after_speech applies at once too; an interrupt scheduled answers 202
    stop = await c.post("/v1/sessions/s1/interrupt", json={"when": {"at": "after_speech"}})
    assert stop.status_code == 202 and stop.json()["scheduled"]["kind"] == "interrupt", stop.text
    await applied(api, "s1", stop.json()["scheduled"]["id"])


async def _calls(api: Api, sid: str) -> list[dict[str, Any]] | None:
    items = (await api.client.get(f"/v1/sessions/{sid}/tool-calls")).json()["items"]
    return list(items) or None


async def test_idempotent_cancel_cap_and_close(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduled_module, "MAX_SCHEDULED", 2)
    await api.create(id="s1", llm={"provider": "scripted", "turns": [{"text": LONG}]})
    c = api.client
    await c.post("/v1/sessions/s1/input", json={"text": "talk"})
    await until(lambda: speaking(api, "s1"))
    body = {"text": "Later.", "when": {"at": "idle"}}
    first = await c.post("/v1/sessions/s1/say", json=body, headers={"Idempotency-Key": "k1"})
    replay = await c.post("/v1/sessions/s1/say", json=body, headers={"Idempotency-Key": "k1"})
    assert first.status_code == replay.status_code == 202
    assert first.json()["scheduled"]["id"] == replay.json()["scheduled"]["id"]
    second = await c.post("/v1/sessions/s1/say", json={"text": "Two.", "when": {"at": "idle"}})
    assert second.status_code == 202
    assert_problem(await c.post("/v1/sessions/s1/say", json=body), 409, "too_many_scheduled")
    sid_one = first.json()["scheduled"]["id"]
    cancelled = await c.delete(f"/v1/sessions/s1/scheduled/{sid_one}")
    assert cancelled.status_code == 200 and cancelled.json()["reason"] == "cancelled_by_operator"
    assert_problem(await c.delete(f"/v1/sessions/s1/scheduled/{sid_one}"), 409, "already_ended")
    note = await c.post("/v1/sessions/s1/coach", json={"note": "be brief"})
    assert note.status_code == 202
    assert (await c.delete("/v1/sessions/s1")).status_code == 204
    for command_id in (second.json()["scheduled"]["id"], note.json()["id"]):
        found = await scheduled(api, "s1", command_id)
        assert found["state"] == "cancelled" and found["reason"] == "session_closed"
    events = await event_types(api, "s1")
    assert [e["type"] for e in events].count("scheduled.cancelled") == 3
    assert events[-1]["type"] == "session.closed"
    assert await chat_texts(api, "s1", "assistant") == [] or "Two." not in await chat_texts(api, "s1", "assistant")


async def test_coach_reaches_the_next_reply_only_and_not_the_chat(api: Api) -> None:
    turns = [{"text": "One {{coach}}"}, {"text": "Two {{coach}}"}]
    await api.create(id="s1", llm={"provider": "scripted", "turns": turns})
    c = api.client
    r = await c.post("/v1/sessions/s1/coach", json={"note": "offer the upgrade"}, headers={"Idempotency-Key": "n1"})
    assert r.status_code == 202 and r.json()["state"] == "pending", r.text
    note_id = r.json()["id"]
    too_long = "x" * (Settings().max_text_chars + 1)
    assert_problem(await c.post("/v1/sessions/s1/coach", json={"note": too_long}), 413, "text_too_long")
    await c.post("/v1/sessions/s1/input", json={"text": "hi"})
    await applied(api, "s1", note_id)
    await until(lambda: _said(api, "s1", 1))
    await c.post("/v1/sessions/s1/input", json={"text": "and?"})
    said = await until(lambda: _said(api, "s1", 2))
    assert said == ["One offer the upgrade", "Two <none>"]
    chat = (await c.get("/v1/sessions/s1/chat")).json()["items"]
    assert not any("offer the upgrade" in json.dumps(it) and it.get("role") != "assistant" for it in chat)
    events = await event_types(api, "s1")
    coached = [e["data"] for e in events if e["type"] == "session.coached"]
    assert coached == [{"id": note_id, "note": "offer the upgrade"}]
    trail = [e["data"] for e in events if e["type"] == "operator.action" and e["data"]["action"] == "coach"]
    assert [t["scheduled_id"] for t in trail] == [note_id]


async def _said(api: Api, sid: str, n: int) -> list[str] | None:
    said = await chat_texts(api, sid, "assistant")
    return said if len(said) >= n else None


async def test_a_restart_keeps_what_is_scheduled_and_applies_it_once(settings: Any, registry: AgentRegistry) -> None:
    async with _api(settings, registry) as api:
        await api.create(id="s1", llm={"provider": "scripted", "turns": [{"text": LONG}, {"text": "Again {{coach}}"}]})
        c = api.client
        await c.post("/v1/sessions/s1/input", json={"text": "talk"})
        await until(lambda: speaking(api, "s1"))
        r = await c.post("/v1/sessions/s1/input", json={"text": "after the restart", "when": {"at": "idle"}})
        command_id = r.json()["scheduled"]["id"]
        note_id = (await c.post("/v1/sessions/s1/coach", json={"note": "apologise"})).json()["id"]
    async with _api(settings, registry) as api:  # the same database: the session is recovered here
        await applied(api, "s1", command_id)
        await applied(api, "s1", note_id)
        assert (await chat_texts(api, "s1", "user")).count("after the restart") == 1
        said = await until(lambda: _said(api, "s1", 1))
        assert any("apologise" in s for s in said), said
