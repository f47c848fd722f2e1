"""An operator's takeover over HTTP (SQLite and PostgreSQL): take over, speak as the agent, hand back; who holds the
session is on the session resource, in the events and in the audit trail; a second operator gets 409 unless it
forces; the POSTs honour Idempotency-Key; and a held session is still held after a restart of the service."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from switchboard.api.app import create_app
from switchboard.runtime.agent import AgentRegistry
from tests.e2e.test_faults import PG_URL, pg_database
from tests.waiting import until

from .conftest import Api, make_settings
from .test_sessions_api import assert_problem

ALICE = "alice-desk-key-0123456789"
BOB = "bob-desk-key-0123456789ab"
READER = "reader-key-0123456789abcd"
CONTROL = ["sessions:read", "sessions:write", "sessions:control"]
KEYS = [
    {"key": ALICE, "name": "alice", "scopes": CONTROL},
    {"key": BOB, "name": "bob", "scopes": CONTROL},
    {"key": READER, "name": "reader", "scopes": ["sessions:read", "sessions:write"]},
]
# a speech that outlasts the requests sent before the takeover, however loaded the machine (60 s at 100 words a
# second): the takeover is what ends it
LONG = " ".join(f"word{i}" for i in range(6000))


def as_(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@asynccontextmanager
async def serving(settings: Any, registry: AgentRegistry) -> AsyncIterator[Api]:
    app = create_app(settings, registry=registry)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=as_(ALICE)) as client:
            yield Api(client, app)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
async def database(request: pytest.FixtureRequest, tmp_path: Any) -> AsyncIterator[str]:
    """The URL of a database of the test's own: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path}/takeover.db"
        return
    async with pg_database() as name:
        yield make_url(PG_URL).set(database=name).render_as_string(hide_password=False)


def settings_for(tmp_path: Any, url: str) -> Any:
    return make_settings(tmp_path, database_url=url, api_keys=KEYS)


async def export(api: Api, sid: str) -> dict[str, Any]:
    r = await api.client.get(f"/v1/sessions/{sid}/export")
    assert r.status_code == 200, r.text
    return dict(json.loads(r.content))


async def event_types(api: Api, sid: str) -> list[str]:
    return [e["type"] for e in (await export(api, sid))["events"]]


async def events_of(api: Api, sid: str, type_: str, count: int = 1) -> list[dict[str, Any]]:
    async def found() -> list[dict[str, Any]] | None:
        logged = [e for e in (await export(api, sid))["events"] if e["type"] == type_]
        return logged if len(logged) >= count else None

    return list(await until(found, every_s=0.05))


async def generations(api: Api, sid: str) -> int:
    return (await event_types(api, sid)).count("generation.started")


async def test_takeover_round_trip(database: str, tmp_path: Any, registry: AgentRegistry) -> None:
    async with serving(settings_for(tmp_path, database), registry) as api:
        turns = [{"text": LONG}, {"text": "The agent again: about your refund."}]
        sid = (await api.create(llm={"provider": "scripted", "turns": turns}))["id"]
        base = f"/v1/sessions/{sid}"
        assert (await api.client.post(f"{base}/input", json={"text": "hello"})).status_code == 202
        await events_of(api, sid, "speech.started")

        r = await api.client.post(f"{base}/takeover", json={})
        assert r.status_code == 200, r.text
        held = r.json()
        assert held["operator"] == "alice" and held["since"]
        session = (await api.client.get(base)).json()
        assert session["takeover"]["operator"] == "alice" and session["takeover"]["since"] == held["since"]
        taken = (await events_of(api, sid, "session.taken_over"))[0]["data"]
        assert taken["operator"] == "alice" and taken["interrupted_speech_id"]

        asked = await generations(api, sid)
        r = await api.client.post(f"{base}/input", json={"text": "anyone?"})
        assert r.status_code == 202 and r.json()["speech_id"] is None
        r = await api.client.post(f"{base}/takeover/say", json={"text": "Alice here, a human."})
        assert r.status_code == 202, r.text
        spoke = (await events_of(api, sid, "operator.spoke"))[0]["data"]
        assert spoke == {
            "operator": "alice",
            "speech_id": r.json()["speech_id"],
            "item_id": spoke["item_id"],
            "text": "Alice here, a human.",
        }
        speech = (await api.client.get(f"{base}/speeches/{spoke['speech_id']}")).json()
        assert speech["source"] == "operator"
        assert (await api.client.post(f"{base}/input", json={"text": "my refund?"})).status_code == 202
        assert await generations(api, sid) == asked

        r = await api.client.delete(f"{base}/takeover")
        assert r.status_code == 200, r.text
        back = r.json()
        assert back["operator"] == "alice" and back["by"] == "alice" and back["speech_id"]
        assert (await api.client.get(base)).json()["takeover"] is None

        async def replied() -> bool:
            chat = (await api.client.get(f"{base}/chat")).json()["items"]
            return chat[-1].get("text") == "The agent again: about your refund."

        await until(replied)
        chat = (await api.client.get(f"{base}/chat")).json()["items"]
        roles = [(i["role"], i["text"]) for i in chat if i["type"] == "message"]
        assert roles[-4][0] == "assistant" and roles[-4][1] == "Alice here, a human."
        assert roles[-3] == ("user", "my refund?")
        assert roles[-2][0] == "developer" and "human operator (alice)" in roles[-2][1]

        handed = (await events_of(api, sid, "session.handed_back"))[0]["data"]
        assert handed["operator"] == "alice" and handed["reply_speech_id"] == back["speech_id"]
        trail = [
            (e["data"]["action"], e["data"]["actor"]) for e in await events_of(api, sid, "operator.action", count=5)
        ]
        assert ("takeover", "alice") in trail and ("takeover_say", "alice") in trail and ("handback", "alice") in trail


async def test_conflicts_force_and_scopes(database: str, tmp_path: Any, registry: AgentRegistry) -> None:
    async with serving(settings_for(tmp_path, database), registry) as api:
        sid = (await api.create())["id"]
        base = f"/v1/sessions/{sid}"
        assert_problem(await api.client.delete(f"{base}/takeover"), 409, "not_held")
        assert_problem(await api.client.post(f"{base}/takeover/say", json={"text": "hi"}), 409, "not_held")
        assert_problem(await api.client.post(f"{base}/takeover", headers=as_(READER)), 403, "forbidden")

        assert (await api.client.post(f"{base}/takeover")).status_code == 200  # no body: the defaults
        again = await api.client.post(f"{base}/takeover", json={})  # the holder again: a heartbeat
        assert again.status_code == 200 and again.json()["operator"] == "alice"
        body = assert_problem(await api.client.post(f"{base}/takeover", headers=as_(BOB)), 409, "held_by_other")
        assert "alice" in body["detail"]
        r = await api.client.post(f"{base}/takeover/say", json={"text": "hi"}, headers=as_(BOB))
        assert_problem(r, 409, "held_by_other")
        assert_problem(await api.client.delete(f"{base}/takeover", headers=as_(BOB)), 409, "held_by_other")

        r = await api.client.post(f"{base}/takeover", json={"force": True}, headers=as_(BOB))
        assert r.status_code == 200 and r.json() == {**r.json(), "operator": "bob", "displaced": "alice"}
        taken = await events_of(api, sid, "session.taken_over", count=2)
        assert taken[-1]["data"]["displaced"] == "alice"
        actions = await events_of(api, sid, "operator.action", count=2)
        forced = [a["data"] for a in actions if a["data"]["actor"] == "bob"]
        assert forced == [{"action": "takeover", "actor": "bob", "force": True, "displaced": "alice"}]

        r = await api.client.delete(f"{base}/takeover", params={"force": "true"})
        assert r.status_code == 200 and r.json()["by"] == "alice" and r.json()["operator"] == "bob"
        assert (await api.client.get(base)).json()["takeover"] is None

        assert_problem(await api.client.post(f"{base}/takeover", json={"bogus": 1}), 422, "invalid_request")
        assert (await api.client.delete(base)).status_code == 204
        assert_problem(await api.client.post(f"{base}/takeover"), 409, "session_not_active")
        assert_problem(await api.client.post("/v1/sessions/nope/takeover"), 404, "session_not_found")


async def test_the_new_posts_are_idempotent(database: str, tmp_path: Any, registry: AgentRegistry) -> None:
    async with serving(settings_for(tmp_path, database), registry) as api:
        sid = (await api.create())["id"]
        base = f"/v1/sessions/{sid}"
        key = {"Idempotency-Key": "take-1"}
        first = await api.client.post(f"{base}/takeover", json={}, headers=key)
        assert first.status_code == 200, first.text
        replay = await api.client.post(f"{base}/takeover", json={}, headers=key)
        assert replay.status_code == 200 and replay.json() == first.json()
        assert replay.headers.get("idempotent-replayed") == "true"

        say_key = {"Idempotency-Key": "say-1"}
        said = await api.client.post(f"{base}/takeover/say", json={"text": "once"}, headers=say_key)
        again = await api.client.post(f"{base}/takeover/say", json={"text": "once"}, headers=say_key)
        assert said.status_code == again.status_code == 202 and said.json() == again.json()
        other = await api.client.post(f"{base}/takeover/say", json={"text": "twice"}, headers=say_key)
        assert_problem(other, 409, "idempotency_key_reused")

        spoken = await events_of(api, sid, "operator.spoke")
        assert len(spoken) == 1
        assert (await event_types(api, sid)).count("session.taken_over") == 1


async def test_a_held_session_is_held_after_a_restart(database: str, tmp_path: Any, registry: AgentRegistry) -> None:
    settings = settings_for(tmp_path, database)
    turns = [{"text": "Welcome."}, {"text": "The agent is back with you."}]
    async with serving(settings, registry) as api:
        sid = (await api.create(llm={"provider": "scripted", "turns": turns}))["id"]
        base = f"/v1/sessions/{sid}"
        assert (await api.client.post(f"{base}/input", json={"text": "hi"})).status_code == 202
        await events_of(api, sid, "speech.done")
        held = (await api.client.post(f"{base}/takeover")).json()
        assert (await api.client.post(f"{base}/input", json={"text": "are you human?"})).status_code == 202
        asked = await generations(api, sid)

    async with serving(settings, registry) as api:  # the service restarted: the session is recovered, held
        await events_of(api, sid, "session.recovered")
        session = (await api.client.get(base)).json()
        assert session["takeover"]["operator"] == "alice" and session["takeover"]["since"] == held["since"]
        assert (await api.client.post(f"{base}/input", json={"text": "hello??"})).status_code == 202
        assert await generations(api, sid) == asked  # recovered held: no model turn
        back = (await api.client.delete(f"{base}/takeover")).json()
        assert back["speech_id"]

        async def replied() -> bool:
            chat = (await api.client.get(f"{base}/chat")).json()["items"]
            return chat[-1].get("text") == "The agent is back with you."

        await until(replied)


async def test_a_quiet_operator_puts_the_session_in_the_attention_queue(tmp_path: Any, registry: AgentRegistry) -> None:
    settings = make_settings(tmp_path, api_keys=KEYS, attention_operator_quiet_s=0.3)
    async with serving(settings, registry) as api:
        sid = (await api.create())["id"]
        base = f"/v1/sessions/{sid}"
        assert (await api.client.post(f"{base}/takeover")).status_code == 200

        async def quiet() -> dict[str, Any] | None:
            listed = (await api.client.get("/v1/sessions", params={"attention": "true"})).json()["items"]
            found = [r for s in listed if s["id"] == sid for r in s["attention"] if r["code"] == "operator_quiet"]
            return found[0] if found else None

        reason = await until(quiet, every_s=0.05)
        assert "held by operator alice" in reason["message"]
        # a heartbeat (the holder taking it again, without a key) is a sign of life: the reason clears
        assert (await api.client.post(f"{base}/takeover")).status_code == 200
        codes = [r["code"] for r in (await api.client.get(base)).json()["attention"]]
        assert "operator_quiet" not in codes
        assert (await api.client.delete(f"{base}/takeover")).status_code == 200
        assert await quiet() is None
