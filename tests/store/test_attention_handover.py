"""Why a session needs an operator is the cluster's, not one node's: a node that adopts a session (a drain, a
failover) knows from its durable log that its user is still waiting, and a session that failed is listed by every
node. Hosts built as ``app.py`` builds them, on SQLite and PostgreSQL; each "process" is a store and a host."""

from __future__ import annotations

import asyncio
from typing import Any

from switchboard.control.attention import AttentionCode
from switchboard.control.host import SessionHost
from switchboard.control.hub import EventHub
from switchboard.control.session_config import PlayoutSettings, SessionConfig
from switchboard.control.settings import Settings
from switchboard.runtime import event_types as ev
from switchboard.runtime.agent import AgentRegistry
from switchboard.runtime.events import EventLog
from switchboard.store import SessionRecord, Store
from tests.waiting import WAIT_S

from .conftest import Db
from .test_recovery import Worker


class Node:
    def __init__(self, db: Db, agents: dict[str, Any]) -> None:
        self.db = db
        self.agents = agents

    async def start(self) -> Node:
        self.store: Store = self.db.store()
        await self.store.migrate()
        await self.store.start()
        settings = Settings(database_url=self.db.url, words_per_second=500, attention_silence_s=0.2)
        self.host = SessionHost(
            store=self.store, registry=AgentRegistry(self.agents), hub=EventHub(), settings=settings
        )
        await self.host.recover_all()
        return self

    async def stop(self) -> None:
        await self.host.aclose()
        await self.store.aclose()

    async def codes(self) -> dict[str, list[AttentionCode]]:
        views = await self.host.needing_attention()
        return {v.id: [r.code for r in self.host.attention_reasons(v)] for v in views}


async def test_a_session_adopted_while_its_user_waits_is_listed_by_its_new_node(db: Db) -> None:
    first = await Node(db, {"worker": Worker}).start()
    slow = {"text": "at last", "ttft_ms": 60_000}
    llm = {"provider": "scripted", "turns": [slow, slow]}  # the model does not answer, before or after the restart
    await first.host.create(SessionConfig(id="s", agent="worker", llm=llm, playout=PlayoutSettings()), {})
    await first.host.sessions["s"].input("hello?")
    async with asyncio.timeout(WAIT_S):  # the first node lists it too, once the user has waited long enough
        while "s" not in await first.codes():
            await asyncio.sleep(0.05)
    await first.stop()  # a graceful restart: the reply is owed, its user still waits

    second = await Node(db, {"worker": Worker}).start()
    try:
        assert second.host.recovered == ["s"]
        found = await second.codes()
        assert found.get("s") == [AttentionCode.SILENCE_AFTER_INPUT], found
    finally:
        await second.stop()


async def test_a_session_that_failed_on_one_node_is_listed_by_every_node(db: Db) -> None:
    first = await Node(db, {"worker": Worker, "retired": Worker}).start()
    llm = {"provider": "scripted", "turns": []}
    await first.host.create(SessionConfig(id="gone", agent="retired", llm=llm), {})
    await first.stop()
    failing = await Node(db, {"worker": Worker}).start()  # its agent is no longer registered: it fails here
    try:
        assert failing.host.failed == ["gone"]
    finally:
        await failing.stop()

    other = await Node(db, {"worker": Worker}).start()  # another node, that never saw it fail
    try:
        found = await other.codes()
        assert found == {"gone": [AttentionCode.SESSION_FAILED]}
        (view,) = await other.host.needing_attention()
        assert "unknown agent 'retired'" in other.host.attention_reasons(view)[0].message
    finally:
        await other.stop()


async def test_recent_events_of_chosen_kinds_are_read_with_the_sessions(db: Db) -> None:
    store = db.store()
    await store.migrate()
    await store.start()
    await store.create_session(SessionRecord(id="a", agent="worker", state="active"))
    events = EventLog("a", store.event_sink())
    for n in range(5):
        events.emit(ev.SpeechCreated(speech_id=f"sp{n}", source="reply"))
        events.emit(ev.AgentStateChanged(state="thinking"))
    await events.flushed()
    loaded = await store.load_sessions_bulk(["a"], recent_types=["speech.created"], recent_limit=3)
    assert [e.data["speech_id"] for e in loaded["a"].recent] == ["sp2", "sp3", "sp4"]
    assert (await store.load_sessions_bulk(["a"]))["a"].recent == []


async def test_of_the_tools_that_ended_only_each_tools_last_end_is_read_and_only_when_it_failed(db: Db) -> None:
    # a tool ends at every call: the window holds the other kinds, and of the tools the ones failing now
    store = db.store()
    await store.migrate()
    await store.start()
    await store.create_session(SessionRecord(id="a", agent="worker", state="active"))
    events = EventLog("a", store.event_sink())

    def ended(n: int, name: str, status: str) -> None:
        events.emit(ev.ToolEnded(call_id=f"c{n}", name=name, status=status, output=f"out {n}", is_error=False))

    ended(1, "pay", "failed")  # older than the window, and still pay's last end
    ended(2, "book", "failed")
    ended(3, "book", "completed")  # book works again
    for n in range(4, 9):
        ended(n, "look", "completed")
    for n in range(3):
        events.emit(ev.SpeechCreated(speech_id=f"sp{n}", source="reply"))
    await events.flushed()
    kinds = ["speech.created", "tool.ended"]
    recent = (await store.load_sessions_bulk(["a"], recent_types=kinds, recent_limit=2))["a"].recent
    assert [(e.type, e.data.get("call_id") or e.data.get("speech_id")) for e in recent] == [
        ("tool.ended", "c1"),
        ("speech.created", "sp1"),
        ("speech.created", "sp2"),
    ]
    await store.aclose()
