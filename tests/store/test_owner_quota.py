"""A session owner's quota counted in the database (cluster mode): ``create_session(..., owner_quota=N)`` inserts the
row only while its owner has fewer than N live sessions, counted in the insert's own transaction; on PostgreSQL under
the owner's advisory lock, so that several stores (nodes) creating for one owner at once cannot pass it together."""

from __future__ import annotations

import asyncio

import pytest

from switchboard.runtime.status import SessionStatus
from switchboard.store import QuotaFull, SessionExists, SessionRecord, Store

from .conftest import ON_POSTGRESQL, Db


def owned(sid: str, owner: str) -> SessionRecord:
    return SessionRecord(id=sid, agent="demo", state=SessionStatus.ACTIVE, config={"agent": "demo", "owner": owner})


async def live_ids(db: Db, owner: str) -> set[str]:
    rows = await db.sql("SELECT id, config, state FROM sessions")
    return {sid for sid, config, state in rows if owner in str(config) and state in ("active", "initializing")}


async def started(db: Db) -> Store:
    store = db.store()
    await store.migrate()
    await store.start()
    return store


async def test_an_owner_gets_its_quota_of_live_sessions_and_an_ended_one_frees_its_place(db: Db):
    store = await started(db)
    for sid in ("a1", "a2"):
        await store.create_session(owned(sid, "key-a"), owner_quota=2)
    with pytest.raises(QuotaFull):
        await store.create_session(owned("a3", "key-a"), owner_quota=2)
    with pytest.raises(SessionExists):  # fails after the count: nothing of it stays counted
        await store.create_session(owned("a1", "key-b"), owner_quota=1)
    await store.create_session(owned("b1", "key-b"), owner_quota=1)  # another owner: its own quota
    assert await store.get_session("a3") is None

    await store.mark_session("a1", SessionStatus.CLOSED)
    await store.create_session(owned("a3", "key-a"), owner_quota=2)
    await store.mark_session("a2", SessionStatus.FAILED)
    await store.create_session(owned("a4", "key-a"), owner_quota=2)
    with pytest.raises(QuotaFull):
        await store.create_session(owned("a5", "key-a"), owner_quota=2)
    assert await live_ids(db, "key-a") == {"a3", "a4"}


@ON_POSTGRESQL
async def test_creates_for_one_owner_from_two_stores_at_once_stop_at_the_quota(db: Db):
    """Two nodes' stores each fire creates for one owner at the same time: the quota in all, every round."""
    stores = [await started(db), await started(db)]

    async def create(store: Store, sid: str, owner: str) -> bool:
        try:
            await store.create_session(owned(sid, owner), owner_quota=4)
        except QuotaFull:
            return False
        return True

    for round_ in range(5):
        owner = f"key-{round_}"
        made = await asyncio.gather(*(create(stores[i % 2], f"r{round_}-{i}", owner) for i in range(20)))
        assert sum(made) == 4, made
        assert len(await live_ids(db, owner)) == 4
