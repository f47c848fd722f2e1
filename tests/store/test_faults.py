"""Faults: corrupt rows are skipped and reported; a database that goes away loses nothing once it is back."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from switchboard.runtime import event_types as ev
from switchboard.runtime.agent import Agent
from switchboard.runtime.chat import ChatMessage
from switchboard.runtime.events import Event, EventLog
from switchboard.runtime.llm.scripted import ScriptedLLM
from switchboard.runtime.playout import SimulatedPlayout
from switchboard.runtime.ports import Commit
from switchboard.runtime.session import AgentSession
from switchboard.runtime.tools import ToolCallInfo
from switchboard.store import IdempotencyRecord, SessionRecord, Store

from .conftest import Db, wait_for

KILL_PHASE_S = 0.5


def msg(item_id: str) -> ChatMessage:
    return ChatMessage(id=item_id, role="user", text=item_id)


async def test_idempotency_put_get_purge(store: Store) -> None:
    old = IdempotencyRecord(
        key="k1",
        scope="POST /v1/sessions/s1/input",
        request_hash="h1",
        status_code=202,
        response_body={"item_id": "i1", "speech_id": None},
        created_at=datetime.now(UTC) - timedelta(hours=2),
    )
    assert await store.idempotency_put(old) is True
    assert await store.idempotency_put(old.model_copy(update={"request_hash": "h2", "status_code": 500})) is False
    assert await store.idempotency_get("k1", "POST /v1/sessions/s1/input") == old
    assert await store.idempotency_get("k1", "POST /v1/sessions/s2/input") is None
    fresh = IdempotencyRecord(key="k1", scope="POST /v1/sessions/s2/input", request_hash="h", status_code=201)
    assert await store.idempotency_put(fresh) is True  # same key, other scope
    assert await store.idempotency_purge(datetime.now(UTC) - timedelta(hours=1)) == 1
    assert await store.idempotency_get("k1", "POST /v1/sessions/s1/input") is None
    assert await store.idempotency_get("k1", "POST /v1/sessions/s2/input") == fresh


async def test_corrupt_rows_are_skipped_and_reported(db: Db, store: Store, caplog: pytest.LogCaptureFixture) -> None:
    chat = store.chat_store()
    await chat.commit("s1", Commit(items=[msg("m0"), msg("m1"), msg("m2")]))
    now = datetime.now(UTC)
    await chat.commit("s1", Commit(tool_calls=[ToolCallInfo(call_id=c, name="t", started_at=now) for c in ("a", "b")]))
    sink = store.event_sink()
    for seq in (1, 2, 3):
        sink.publish(Event(seq=seq, session_id="s1", type="x"))
    await sink.publish(Event(seq=4, session_id="s1", type="x"))

    cast = "" if db.kind == "sqlite" else "::jsonb"
    await db.sql(db.q(f"UPDATE chat_items SET data = ?{cast} WHERE pos = 1"), '{"type": "bogus", "id": "m1"}')
    await db.sql(db.q(f"UPDATE tool_calls SET progress = ?{cast} WHERE call_id = 'b'"), '[{"message": 3}]')
    await db.sql(db.q(f"UPDATE events SET data = ?{cast} WHERE seq = 2"), "[1, 2]")
    if db.kind == "sqlite":  # only SQLite can hold text that is not JSON at all
        await db.sql("UPDATE chat_items SET data = 'not json {' WHERE pos = 2")
    else:
        await db.sql("UPDATE chat_items SET data = 'null'::jsonb WHERE pos = 2")

    assert [it.id for it in await store.chat_items("s1")] == ["m0"]
    assert [c.call_id for c in await store.tool_calls("s1")] == ["a"]
    assert await store.tool_call("s1", "b") is None
    assert [e.seq for e in await store.events("s1")] == [1, 3, 4]
    assert [e.seq for _, e in await store.events_multi(session_ids=["s1"], since_id=0, limit=10)] == [1, 3, 4]

    assert store.read_errors == 6
    reported = {(e.table, e.session_id, e.key) for e in store.read_error_log}
    assert reported == {
        ("chat_items", "s1", "1"),
        ("chat_items", "s1", "2"),
        ("tool_calls", "s1", "b"),
        ("events", "s1", "2"),
    }
    assert "skipping unreadable chat_items row (session s1, pos=1)" in caplog.text


async def _load(store: Store, log: EventLog, sid: str, n: int, tag: str) -> None:
    """``n`` commits with a chat item each, and an event after each, like a session would."""
    chat = store.chat_store()
    for i in range(n):
        item = msg(f"{sid}-{tag}-{i}")
        await chat.commit(sid, Commit(items=[item]))
        log.emit(ev.ChatItemAdded(item=item))


async def _check_complete(db: Db, store: Store, logs: dict[str, EventLog], expected: dict[str, list[str]]) -> None:
    for sid, log in logs.items():
        seqs = [e.seq for e in await store.events(sid, limit=100_000)]
        assert seqs == list(range(1, log.last_seq + 1)), f"{sid}: events lost or duplicated"
        rows = await db.sql(db.q("SELECT pos, item_id FROM chat_items WHERE session_id = ? ORDER BY pos"), sid)
        assert [int(p) for p, _ in rows] == list(range(len(rows)))
        assert [i for _, i in rows] == expected[sid], f"{sid}: items lost or reordered"


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
async def test_sqlite_locked_then_released_loses_nothing(db: Db, caplog: pytest.LogCaptureFixture) -> None:
    store = db.store(busy_timeout_ms=20)
    await store.migrate()
    await store.start()
    sids = ["a", "b", "c"]
    for sid in sids:
        await store.create_session(SessionRecord(id=sid, agent="demo", state="active"))
    logs = {sid: EventLog(sid, store.event_sink()) for sid in sids}
    await asyncio.gather(*(_load(store, logs[sid], sid, 5, "before") for sid in sids))

    blocker = sqlite3.connect(str(db.path), isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # another process holding the write lock: the database is unwritable
    try:
        load = asyncio.gather(*(_load(store, logs[sid], sid, 20, "during") for sid in sids))
        await wait_for(lambda: store.writer.retries >= 3)
        assert not load.done()
        assert await store.ping() is False
    finally:
        blocker.execute("COMMIT")
        blocker.close()
    await load
    await logs["a"].emit(ev.SessionClosed())
    assert await store.ping() is True
    expected = {sid: [f"{sid}-before-{i}" for i in range(5)] + [f"{sid}-during-{i}" for i in range(20)] for sid in sids}
    await _check_complete(db, store, logs, expected)
    assert "database unavailable" in caplog.text and "session(s) a" in caplog.text


@pytest.mark.postgres
@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
async def test_postgres_connections_killed_repeatedly_loses_nothing(db: Db, caplog: pytest.LogCaptureFixture) -> None:
    app = f"sbtest-{uuid.uuid4().hex[:8]}"
    store = db.store(application_name=app)
    await store.migrate()
    await store.start()
    sids = ["a", "b", "c"]
    for sid in sids:
        await store.create_session(SessionRecord(id=sid, agent="demo", state="active"))
    logs = {sid: EventLog(sid, store.event_sink()) for sid in sids}
    kill = "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1"

    await asyncio.gather(*(_load(store, logs[sid], sid, 5, "before") for sid in sids))
    await db.sql(kill, app)  # the writer's idle connection dies: its next batch must be retried
    await asyncio.gather(*(_load(store, logs[sid], sid, 5, "next") for sid in sids))
    assert store.writer.retries >= 1

    # Now kill its connections over and over (new ones too) for a while, during a steady load.
    retries_before = store.writer.retries
    load = asyncio.gather(*(_load(store, logs[sid], sid, 40, "during") for sid in sids))
    loop = asyncio.get_running_loop()
    until = loop.time() + KILL_PHASE_S
    while loop.time() < until and not load.done():
        await db.sql(kill, app)
        await asyncio.sleep(0.01)
    await load
    assert store.writer.retries > retries_before
    await logs["a"].emit(ev.SessionClosed())
    expected = {
        sid: [f"{sid}-{tag}-{i}" for tag, n in (("before", 5), ("next", 5), ("during", 40)) for i in range(n)]
        for sid in sids
    }
    await _check_complete(db, store, logs, expected)
    assert await store.ping() is True
    assert "database unavailable" in caplog.text


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
async def test_a_session_commit_during_an_outage_is_written_once_and_in_order(db: Db) -> None:
    # The store alone retries while its database is unavailable (the ChatStore port): the session hands each
    # commit over once and waits; nothing is written twice, nothing overtakes the commit caught by the outage.
    store = db.store(busy_timeout_ms=20)
    await store.migrate()
    await store.start()
    await store.create_session(SessionRecord(id="s1", agent="demo", state="active"))
    session = AgentSession(
        session_id="s1",
        agent=Agent(instructions="test agent"),
        llm=ScriptedLLM([]),
        playout=SimulatedPlayout(),
        store=store.chat_store(),
        events=store.event_sink(),
    )
    await session.commit(Commit(items=[msg("before")]))

    blocker = sqlite3.connect(str(db.path), isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # the database is unwritable until the blocker lets go
    try:
        first = asyncio.create_task(session.commit(Commit(items=[msg("during-0")])))
        await wait_for(lambda: store.writer.retries >= 3)
        rest = [asyncio.create_task(session.commit(Commit(items=[msg(f"during-{i}")]))) for i in (1, 2)]
        await asyncio.sleep(0.05)
        assert not first.done() and not any(t.done() for t in rest)
    finally:
        blocker.execute("COMMIT")
        blocker.close()
    await asyncio.gather(first, *rest)
    await session.commit(Commit(items=[msg("after")]))

    rows = await db.sql(db.q("SELECT pos, item_id FROM chat_items WHERE session_id = ? ORDER BY pos"), "s1")
    assert [i for _, i in rows] == ["before", "during-0", "during-1", "during-2", "after"]
    assert [int(p) for p, _ in rows] == [0, 1, 2, 3, 4]
    assert store.writer.failed_ops == 0
    await store.aclose()
