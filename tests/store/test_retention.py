"""Retention: sessions that ended long enough ago are deleted with everything they left; nothing else is."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from switchboard.runtime.chat import ChatMessage
from switchboard.runtime.events import Event
from switchboard.runtime.ports import Commit
from switchboard.store import SessionRecord, Store

from .conftest import Db

NOW = datetime.now(UTC)
LONG_AGO = NOW - timedelta(days=30)


async def _session(store: Store, sid: str, state: str, updated_at: datetime) -> None:
    await store.create_session(SessionRecord(id=sid, agent="demo", state=state, updated_at=updated_at))
    await store.chat_store().commit(sid, Commit(items=[ChatMessage(id=f"m-{sid}", role="user", text="hi")]))
    await store.event_sink().publish(Event(seq=1, session_id=sid, type="session.started", data={"agent": "demo"}))


async def _count(db: Db, table: str, sid: str) -> int:
    return int((await db.sql(db.q(f"SELECT COUNT(*) FROM {table} WHERE session_id = ?"), sid))[0][0])


async def test_only_sessions_that_ended_before_the_cutoff_are_deleted(db: Db) -> None:
    store = db.store()
    await store.migrate()
    await store.start()
    await _session(store, "closed-old", "closed", LONG_AGO)
    await _session(store, "failed-old", "failed", LONG_AGO)
    await _session(store, "closed-new", "closed", NOW)
    await _session(store, "live-old", "active", LONG_AGO)  # a live session is never deleted, however old

    purged = await store.purge_ended_sessions(NOW - timedelta(days=7))
    assert sorted(purged) == ["closed-old", "failed-old"]
    for sid in purged:
        assert await store.get_session(sid) is None
        for table in ("chat_items", "events"):
            assert await _count(db, table, sid) == 0, (table, sid)
    for sid in ("closed-new", "live-old"):
        assert await store.get_session(sid) is not None
        assert await _count(db, "chat_items", sid) == 1 and await _count(db, "events", sid) == 1
    assert await store.purge_ended_sessions(NOW - timedelta(days=7)) == []

    # the id is free again: a new session under it starts from nothing
    await _session(store, "closed-old", "active", NOW)
    assert [it.id for it in await store.chat_items("closed-old")] == ["m-closed-old"]
