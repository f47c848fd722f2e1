"""The audit trail of operator commands (`operator.action` events), the export of a whole session, and what has been
heard so far of a speech that is still playing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest

from switchboard.api.app import create_app
from switchboard.api.sessions import export
from switchboard.api.sessions.export import EXPORT_EVENTS_PAGE
from switchboard.runtime.agent import AgentRegistry
from switchboard.runtime.chat import ChatItem
from switchboard.store import store as store_module
from switchboard.store.rows import items_from_texts

from .conftest import Api, make_settings
from .test_attention import until
from .test_sessions_api import assert_problem

KEY = "night-desk-key-0123456789"
READER_KEY = "reader-key-0123456789abcd"
ALL_SCOPES = ["sessions:read", "sessions:write", "sessions:control", "tools:cancel"]


@pytest.fixture
async def keyed(tmp_path: Any, registry: AgentRegistry) -> AsyncIterator[Api]:
    keys = [
        {"key": KEY, "name": "night-desk", "scopes": ALL_SCOPES},
        {"key": READER_KEY, "scopes": ALL_SCOPES},  # no name: it goes by a digest, never by a part of the key
    ]
    app = create_app(make_settings(tmp_path, api_keys=keys), registry=registry)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=headers) as client:
            yield Api(client, app)


async def events(api: Api, sid: str, type_: str | None = None, *, count: int = 0) -> list[dict[str, Any]]:
    """The session's durable events (of ``type_``), once there are at least ``count`` of them: a command answers
    before its audit event is durable (it is written with the session's next group commit)."""

    async def found() -> list[dict[str, Any]] | None:
        r = await api.client.get(f"/v1/sessions/{sid}/export")
        assert r.status_code == 200, r.text
        logged = [e for e in json.loads(r.content)["events"] if type_ is None or e["type"] == type_]
        return logged if len(logged) >= count else None

    return list(await until(found, every_s=0.1)) if count else list(await found() or [])


async def test_each_applied_command_is_in_the_trail_with_who_and_the_key(keyed: Api) -> None:
    api = keyed
    turns = [{"text": "one two three four five six seven eight nine ten " * 5}]
    turns.append({"text": "On it.", "tool_calls": [{"name": "search", "arguments": {"query": "lamps", "seconds": 30}}]})
    await api.create(id="t1", llm={"provider": "scripted", "turns": turns})
    c = api.client
    assert (await c.post("/v1/sessions/t1/input", json={"text": "hi"}, headers={"Idempotency-Key": "in-1"})).is_success
    # a replay of the same command is not applied again, and not logged again
    assert (await c.post("/v1/sessions/t1/input", json={"text": "hi"}, headers={"Idempotency-Key": "in-1"})).is_success
    assert (await c.post("/v1/sessions/t1/input", json={"text": "hm", "final": False})).is_success  # interim: no line
    await until(lambda: _speaking(api, "t1"))
    interrupted = await c.post("/v1/sessions/t1/interrupt", json={"force": True})
    assert interrupted.json()["interrupted"], interrupted.text
    other = {"Authorization": f"Bearer {READER_KEY}"}
    assert (await c.post("/v1/sessions/t1/say", json={"text": "Sorry."}, headers=other)).is_success
    assert (await c.post("/v1/sessions/t1/input", json={"text": "search"})).is_success
    call = await until(lambda: _running(api, "t1"))
    assert (await c.post(f"/v1/sessions/t1/tool-calls/{call}/cancel", headers={"Idempotency-Key": "c-1"})).is_success
    # refused commands change nothing: no line
    assert_problem(await c.post(f"/v1/sessions/t1/tool-calls/{call}/cancel"), 409, "already_ended")
    assert (await c.delete("/v1/sessions/t1")).status_code == 204

    trail = await events(api, "t1", "operator.action", count=6)
    digest = trail[2]["data"]["actor"]
    assert digest.startswith("key:") and READER_KEY[:4] not in digest
    assert [(e["data"]["action"], e["data"]["actor"], e["data"].get("idempotency_key")) for e in trail] == [
        ("input", "night-desk", "in-1"),
        ("interrupt", "night-desk", None),
        ("say", digest, None),
        ("input", "night-desk", None),
        ("cancel_tool", "night-desk", "c-1"),
        ("close", "night-desk", None),
    ]
    assert trail[1]["data"]["force"] is True and trail[1]["data"]["speech_id"]
    assert trail[4]["data"]["call_id"] == call
    chat = (await c.get("/v1/sessions/t1/chat")).json()["items"]
    hi = next(i for i in chat if i.get("text") == "hi")
    assert trail[0]["data"]["item_id"] == hi["id"]
    everything = json.dumps(await events(api, "t1"))
    assert KEY not in everything and READER_KEY not in everything
    log = await events(api, "t1")
    assert log[-1]["type"] == "session.closed" and log[-2]["type"] != "session.closed"
    assert [e["seq"] for e in log] == list(range(1, len(log) + 1))


async def _speaking(api: Api, sid: str) -> bool:
    return bool((await api.client.get(f"/v1/sessions/{sid}")).json()["agent_state"] == "speaking")


async def _running(api: Api, sid: str) -> str | None:
    items = (await api.client.get(f"/v1/sessions/{sid}/tool-calls", params={"status": "running"})).json()["items"]
    return str(items[0]["call_id"]) if items else None


async def test_without_keys_the_actor_is_anonymous(api: Api) -> None:
    await api.create(id="a1", llm={"provider": "scripted", "turns": []})
    assert (await api.client.post("/v1/sessions/a1/say", json={"text": "Hello."})).is_success
    [action] = await events(api, "a1", "operator.action", count=1)
    assert action["data"] == {"action": "say", "actor": "anonymous", "speech_id": action["data"]["speech_id"]}


async def test_export_is_one_document_for_a_closed_session(api: Api) -> None:
    turns = [
        {"text": "Let me look.", "tool_calls": [{"name": "book", "arguments": {"what": "a table"}}]},
        {"text": "Booked."},
    ]
    await api.create(id="x1", llm={"provider": "scripted", "turns": turns}, metadata={"caller": "+41 22"})
    await api.client.post("/v1/sessions/x1/input", json={"text": "book a table"})

    async def booked() -> bool:
        items = (await api.client.get("/v1/sessions/x1/chat")).json()["items"]
        return any(i.get("text") == "Booked." for i in items)

    await until(booked)
    assert (await api.client.delete("/v1/sessions/x1")).status_code == 204
    r = await api.client.get("/v1/sessions/x1/export")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.headers["content-disposition"] == 'attachment; filename="session-x1.json"'
    doc = json.loads(r.content)
    assert doc["format"] == "switchboard.session-export/1"
    assert doc["session"]["id"] == "x1" and doc["session"]["state"] == "closed"
    assert doc["session"]["metadata"] == {"caller": "+41 22"}
    assert doc["chat"] == (await api.client.get("/v1/sessions/x1/chat")).json()["items"]
    calls = [(c["name"], c["status"], c["output"]) for c in doc["tool_calls"]]
    assert calls == [("book", "completed", "booked a table")]
    types = [e["type"] for e in doc["events"]]
    assert types[0] == "session.started" and types[-1] == "session.closed" and "tool.ended" in types
    assert_problem(await api.client.get("/v1/sessions/nope/export"), 404, "session_not_found")


async def test_export_streams_a_log_longer_than_a_page(api: Api) -> None:
    await api.create(id="long", llm={"provider": "scripted", "turns": []})
    says = EXPORT_EVENTS_PAGE // 5 + 10  # each say logs several events: more than one page in all
    for i in range(says):
        assert (await api.client.post("/v1/sessions/long/say", json={"text": f"line {i}"})).is_success

    async def all_done() -> bool:
        return len(await events(api, "long", "speech.done")) == says

    await until(all_done, every_s=0.2)  # each look exports the whole log: not so often that it slows the session
    log = await events(api, "long")
    assert len(log) > EXPORT_EVENTS_PAGE
    assert [e["seq"] for e in log] == list(range(1, len(log) + 1))


async def test_export_of_an_ended_session_reads_its_chat_a_page_at_a_time(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export read an ended session's whole chat at once: each export of a long chat held all of it."""
    monkeypatch.setattr(export, "EXPORT_CHAT_PAGE", 7)
    await api.create(id="chatty", llm={"provider": "scripted", "turns": []})
    for i in range(30):
        r = await api.client.post("/v1/sessions/chatty/say", json={"text": f"line {i}", "add_to_chat": True})
        assert r.is_success

    async def all_said() -> bool:
        return len((await api.client.get("/v1/sessions/chatty/chat")).json()["items"]) == 30

    await until(all_said)
    chat = (await api.client.get("/v1/sessions/chatty/chat")).json()["items"]
    assert (await api.client.delete("/v1/sessions/chatty")).status_code == 204
    parsed: list[int] = []

    def counted(texts: Sequence[str]) -> list[ChatItem]:
        parsed.append(len(texts))
        return items_from_texts(texts)

    monkeypatch.setattr(store_module, "items_from_texts", counted)
    doc = json.loads((await api.client.get("/v1/sessions/chatty/export")).content)
    assert doc["chat"] == chat
    assert parsed and max(parsed) <= 7, parsed


async def test_export_needs_the_read_scope(tmp_path: Any, registry: AgentRegistry) -> None:
    keys = [{"key": KEY, "scopes": ["sessions:write"]}]
    app = create_app(make_settings(tmp_path, api_keys=keys), registry=registry)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            headers = {"Authorization": f"Bearer {KEY}"}
            body = {"agent": "tester", "id": "s1"}
            assert (await client.post("/v1/sessions", json=body, headers=headers)).status_code == 201
            assert_problem(await client.get("/v1/sessions/s1/export"), 401, "unauthenticated")
            assert_problem(await client.get("/v1/sessions/s1/export", headers=headers), 403, "forbidden")


async def test_heard_text_grows_while_the_speech_plays(api: Api) -> None:
    await api.create(id="h1", llm={"provider": "scripted", "turns": []}, playout={"words_per_second": 20})
    words = " ".join(f"word{i}" for i in range(60))
    speech_id = (await api.client.post("/v1/sessions/h1/say", json={"text": words})).json()["speech_id"]
    seen: list[str] = []

    async def heard_more() -> bool:
        info = (await api.client.get(f"/v1/sessions/h1/speeches/{speech_id}")).json()
        assert info["played_text"] == "" or info["state"] == "done"
        if info["heard_text"] and (not seen or info["heard_text"] != seen[-1]):
            seen.append(info["heard_text"])
        return len(seen) >= 3

    await until(heard_more)
    assert all(words.startswith(h) for h in seen) and seen[0] != words
    assert [len(h) for h in seen] == sorted(len(h) for h in seen)
    assert (await api.client.post("/v1/sessions/h1/interrupt")).is_success
    info = (await api.client.get(f"/v1/sessions/h1/speeches/{speech_id}")).json()
    assert info["heard_text"] == info["played_text"] and words.startswith(info["played_text"])
