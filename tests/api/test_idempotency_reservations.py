"""Idempotency-Key across failures (I7): the answer is written in the transaction of the command's effect, so a
connection reset or a dead process between the two can no longer apply a command twice; a key held by a live
process is waited for, one held by a dead process is taken over."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from switchboard.api.app import create_app
from switchboard.api.idempotency import _digest
from switchboard.control.settings import Settings
from switchboard.runtime.agent import AgentRegistry
from switchboard.runtime.ports import Completion
from switchboard.store import Holder, NodeMode, NodeRecord, NodeState, Store
from switchboard.store import models as m
from switchboard.store.records import now_utc
from tests.agents_fixture import AGENTS as TEST_AGENTS
from tests.e2e.test_faults import PG_URL, pg_database
from tests.store.test_idempotency_reservations import answers_fail
from tests.waiting import WAIT_S
from tests.webhook_backend import FakeBackend

from .conftest import Api, make_settings
from .test_sessions_api import LONG, assert_problem, until
from .test_webhook_tools import SECRET, SECRET_ENV, Hooks, agents_file, call_turn

TEXT = {"text": "table for two", "interrupt": False}


@contextlib.asynccontextmanager
async def served(settings: Settings, registry: AgentRegistry) -> AsyncIterator[Api]:
    app = create_app(settings, registry=registry)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            yield Api(client, app)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
async def on_both(request: pytest.FixtureRequest, tmp_path: Path, registry: AgentRegistry) -> AsyncIterator[Api]:
    """The API on a SQLite file, or on a PostgreSQL database of its own."""
    if request.param == "sqlite":
        async with served(make_settings(tmp_path), registry) as api:
            yield api
        return
    async with pg_database() as name:
        url = make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
        async with served(make_settings(tmp_path, database_url=url), registry) as api:
            yield api


def store_of(api: Api) -> Store:
    store = api.app.state.services.store
    assert isinstance(store, Store)
    return store


async def texts(api: Api, sid: str, text: str) -> list[str]:
    """The ids of the chat items that hold ``text``, as stored."""
    return [i.id for i in await store_of(api).chat_items(sid) if getattr(i, "text", None) == text]


async def test_a_reset_on_the_answer_never_applies_an_input_twice(on_both: Api):
    """The record was written after the effect, in a transaction of its own and not retried: a connection reset on
    that statement answered 503 although the input was applied, and the retry applied it again."""
    api = on_both
    sid = (await api.create())["id"]
    headers = {"Idempotency-Key": "reset-on-the-answer"}
    with answers_fail() as failed:
        first = await api.client.post(f"/v1/sessions/{sid}/input", json=TEXT, headers=headers)
    assert failed, "the answer was never written"
    retry = await api.client.post(f"/v1/sessions/{sid}/input", json=TEXT, headers=headers)
    stored = await texts(api, sid, TEXT["text"])
    assert len(stored) == 1, f"applied {len(stored)} times (first answered {first.status_code}: {first.text})"
    assert retry.status_code == 202 and retry.headers.get("idempotent-replayed") == "true", retry.text
    assert retry.json()["item_id"] == stored[0]
    assert first.status_code == 202 and first.json() == retry.json(), first.text


async def _scope(api: Api, sid: str) -> str:
    """The scope this caller's keys have on ``sid``'s input route (read from a record the route wrote)."""
    r = await api.client.post(f"/v1/sessions/{sid}/input", json={"text": "probe"}, headers={"Idempotency-Key": "p"})
    assert r.status_code == 202, r.text
    t = m.idempotency_keys
    async with store_of(api).engine.connect() as conn:
        return str((await conn.execute(sa.select(t.c.scope).where(t.c.key == "p"))).scalar_one())


async def _hold(api: Api, key: str, scope: str, holder: Holder, body: dict[str, Any]) -> None:
    """A reservation of ``key`` held by ``holder``, as a request with ``body`` would have made it."""
    assert (await store_of(api).idempotency.reserve(key, scope, _digest(body), holder)).held


async def _node(api: Api, node_id: str, incarnation: str, *, lease_s: float) -> None:
    now = now_utc()
    record = NodeRecord(
        id=node_id,
        url=f"http://{node_id}",
        state=NodeState.LIVE,
        mode=NodeMode.CLUSTER,
        hostname="elsewhere",
        pid=1,
        started_at=now,
        heartbeat_at=now,
        lease_until=now + timedelta(seconds=lease_s),
        incarnation=incarnation,
    )
    assert await store_of(api).nodes.register(record, conflicts=lambda _: False) == []


FULL_INPUT = {"text": "table for two", "final": True, "interrupt": False, "force": False, "reply": True, "role": "user"}


async def test_a_retry_takes_over_the_key_of_a_process_that_died_before_its_effect(api: Api):
    """The first attempt reserved the key, then its process died (killed, or restarted under the same node id)
    before anything was durable: the retry runs the command, once."""
    sid = (await api.create())["id"]
    scope = await _scope(api, sid)
    me = api.app.state.services.host.lease
    await _hold(api, "restarted", scope, Holder(me.node_id, "the-previous-process"), FULL_INPUT)
    await _node(api, "node-gone", "g-1", lease_s=-1)  # its lease is over (by the database's clock)
    await _hold(api, "expired", scope, Holder("node-gone", "g-1"), FULL_INPUT)
    for key in ("restarted", "expired"):
        first = await api.client.post(f"/v1/sessions/{sid}/input", json=TEXT, headers={"Idempotency-Key": key})
        assert first.status_code == 202 and "idempotent-replayed" not in first.headers, first.text
        again = await api.client.post(f"/v1/sessions/{sid}/input", json=TEXT, headers={"Idempotency-Key": key})
        assert again.headers.get("idempotent-replayed") == "true" and again.json() == first.json()
    assert len(await texts(api, sid, TEXT["text"])) == 2  # one per key


async def test_a_retry_waits_for_a_live_holder_and_replays_its_answer(api: Api, monkeypatch: pytest.MonkeyPatch):
    """Another process holds the key and is still applying the command: the retry waits for its answer and replays
    it; it never runs the command beside it."""
    sid = (await api.create())["id"]
    scope = await _scope(api, sid)
    await _node(api, "node-busy", "b-1", lease_s=120)
    await _hold(api, "busy", scope, Holder("node-busy", "b-1"), FULL_INPUT)
    store = store_of(api)
    real_reserve = store.idempotency.reserve
    looked = 0
    polling = asyncio.Event()

    async def counted(*args: Any, **kw: Any) -> Any:
        nonlocal looked
        looked += 1
        if looked >= 2:
            polling.set()
        return await real_reserve(*args, **kw)

    monkeypatch.setattr(store.idempotency, "reserve", counted)
    waiting = asyncio.create_task(
        api.client.post(f"/v1/sessions/{sid}/input", json=TEXT, headers={"Idempotency-Key": "busy"})
    )
    await asyncio.wait_for(polling.wait(), WAIT_S)
    assert not waiting.done()
    answer = {"item_id": "item_from_the_holder", "speech_id": "speech_from_the_holder"}
    holder = {"holder_node": "node-busy", "holder_incarnation": "b-1"}
    assert await store.idempotency.complete(Completion(key="busy", scope=scope, status_code=202, body=answer, **holder))
    r = await waiting
    assert r.status_code == 202 and r.headers.get("idempotent-replayed") == "true" and r.json() == answer
    assert await texts(api, sid, TEXT["text"]) == []  # applied by the holder, never here


async def test_a_holder_that_stays_busy_past_the_deadline_is_a_503_and_nothing_runs(
    tmp_path: Path, registry: AgentRegistry
):
    async with served(make_settings(tmp_path, request_timeout_s=0.5), registry) as api:
        sid = (await api.create())["id"]
        scope = await _scope(api, sid)
        await _node(api, "node-busy", "b-1", lease_s=120)
        await _hold(api, "busy", scope, Holder("node-busy", "b-1"), FULL_INPUT)
        r = await api.client.post(f"/v1/sessions/{sid}/input", json=TEXT, headers={"Idempotency-Key": "busy"})
        assert_problem(r, 503, "idempotency_key_in_use")
        assert r.headers["retry-after"] == "1"
        other = await api.client.post(
            f"/v1/sessions/{sid}/input", json={**TEXT, "text": "else"}, headers={"Idempotency-Key": "busy"}
        )
        assert_problem(other, 409, "idempotency_key_reused")  # another body: no wait
        assert await texts(api, sid, TEXT["text"]) == []


class _SeparateAnswers:
    """Counts the answers written in a transaction of their own (not with an effect)."""

    def __init__(self, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
        self.keys: list[str] = []
        real = store.idempotency.complete

        async def complete(done: Completion) -> bool:
            self.keys.append(done.key)
            return await real(done)

        monkeypatch.setattr(store.idempotency, "complete", complete)


async def _replayed(api: Api, url: str, key: str, first: httpx.Response, body: Any = None) -> None:
    again = await api.client.post(url, json=body, headers={"Idempotency-Key": key})
    assert again.status_code == first.status_code and again.headers.get("idempotent-replayed") == "true", again.text
    assert again.json() == first.json()


async def test_each_command_is_answered_by_its_own_effect(api: Api, monkeypatch: pytest.MonkeyPatch):
    """Create, input, say, interrupt and a tool cancel write their answer with their effect; only what has no
    durable effect (an interrupt with nothing speaking) is answered in a transaction of its own."""
    separate = _SeparateAnswers(store_of(api), monkeypatch)
    turns = [
        {"text": LONG},
        {"text": "Searching.", "tool_calls": [{"name": "search", "arguments": {"query": "q", "seconds": 5}}]},
        {"text": "Started."},
    ]
    body = {"agent": "tester", "llm": {"provider": "scripted", "turns": turns}}
    created = await api.client.post("/v1/sessions", json=body, headers={"Idempotency-Key": "create"})
    assert created.status_code == 201, created.text
    await _replayed(api, "/v1/sessions", "create", created, body)
    url = f"/v1/sessions/{created.json()['id']}"

    idle = await api.client.post(f"{url}/interrupt", headers={"Idempotency-Key": "idle"})
    assert idle.json() == {"speech_id": None, "interrupted": False}
    assert separate.keys == ["idle"]
    said = await api.client.post(f"{url}/say", json={"text": "One moment."}, headers={"Idempotency-Key": "say"})
    await _replayed(api, f"{url}/say", "say", said, {"text": "One moment."})

    async def speaking() -> bool:
        return (await api.client.get(url)).json()["agent_state"] == "speaking"

    talk = await api.client.post(f"{url}/input", json={"text": "talk"}, headers={"Idempotency-Key": "input"})
    await _replayed(api, f"{url}/input", "input", talk, {"text": "talk"})
    await until(speaking)
    stopped = await api.client.post(f"{url}/interrupt", headers={"Idempotency-Key": "interrupt"})
    assert stopped.json() == {"speech_id": talk.json()["speech_id"], "interrupted": True}, stopped.text
    await _replayed(api, f"{url}/interrupt", "interrupt", stopped)

    async def running() -> list[dict[str, Any]]:
        return (await api.client.get(f"{url}/tool-calls", params={"status": "running"})).json()["items"]

    await api.client.post(f"{url}/input", json={"text": "search"})
    call = (await until(running))[0]
    cancel = f"{url}/tool-calls/{call['call_id']}/cancel"
    cancelled = await api.client.post(cancel, headers={"Idempotency-Key": "cancel"})
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
    await _replayed(api, cancel, "cancel", cancelled)
    assert separate.keys == ["idle"]


async def test_webhook_reports_are_answered_by_their_own_effect(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    async with FakeBackend(SECRET) as backend:
        settings = make_settings(tmp_path, agents_file=agents_file(tmp_path, backend))
        async with served(settings, AgentRegistry(TEST_AGENTS)) as api:
            await _reports(Hooks(api.client, backend), _SeparateAnswers(store_of(api), monkeypatch))


async def _reports(hooks: Hooks, separate: _SeparateAnswers) -> None:
    hooks.backend.answers["refund"] = [(202, None)]
    sid = await hooks.session(call_turn("refund", "Refunding."), {"text": "Started."}, {"text": "Done."})
    call_id = (await hooks.backend.next("call"))["call_id"]
    r = await hooks.progress(sid, call_id, "contacting the bank", 0.5, headers={"Idempotency-Key": "p"})
    assert r.status_code == 200 and r.json() == {"call_id": call_id, "status": "running"}, r.text
    r = await hooks.result(sid, call_id, "refunded", headers={"Idempotency-Key": "r"})
    assert r.status_code == 200 and r.json() == {"call_id": call_id, "status": "completed"}, r.text
    replay = await hooks.result(sid, call_id, "refunded", headers={"Idempotency-Key": "r"})
    assert replay.headers.get("Idempotent-Replayed") == "true" and replay.json() == r.json()
    assert separate.keys == []
