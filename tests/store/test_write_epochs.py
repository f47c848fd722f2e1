"""A write carries the epoch it was made under (its fencing token), and lands only while the session's row names this
node at exactly that epoch: a node that lost a session and claimed it back never lands what it had made before, not
even a write still being retried when the new claim came, while what it makes under the new claim lands."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest

from switchboard.runtime.events import Event
from switchboard.runtime.ports import Commit
from switchboard.store import SessionFenced, SessionRecord, sibling_engine
from switchboard.store.engine import sqlite_writer_engine
from switchboard.store.writer import write_fenced
from switchboard.store.writes import Op
from tests.waiting import WAIT_S

from .conftest import Db, pg_dsn, wait_for
from .test_fencing import Node, items, msg

pytestmark = pytest.mark.timeout(60)


class Blocker:
    """Another connection holding session ``sid`` (PostgreSQL: its row, ``FOR UPDATE``; SQLite: the database's write
    lock) inside a transaction of its own, so that a write batch for it waits and then fails as the database being
    unavailable; it may change the row meanwhile."""

    def __init__(self, db: Db) -> None:
        self.db = db
        self._pg: asyncpg.Connection | None = None
        self._lite: sqlite3.Connection | None = None

    async def hold(self, sid: str) -> None:
        if self.db.kind == "sqlite":
            self._lite = sqlite3.connect(str(self.db.path), isolation_level=None)
            self._lite.execute("BEGIN IMMEDIATE")
            return
        self._pg = await asyncpg.connect(pg_dsn(), server_settings={"search_path": self.db.schema or "public"})
        await self._pg.execute("BEGIN")
        await self._pg.execute("SELECT 1 FROM sessions WHERE id = $1 FOR UPDATE", sid)

    async def execute(self, statement: str) -> None:
        if self._lite is not None:
            self._lite.execute(statement)
        else:
            assert self._pg is not None
            await self._pg.execute(statement)

    async def commit(self) -> None:
        if self._lite is not None:
            self._lite.execute("COMMIT")
            self._lite.close()
        elif self._pg is not None:
            await self._pg.execute("COMMIT")
            await self._pg.close()


async def batch_in_flight(db: Db, node: Node, app: str) -> None:
    """Wait until the node's writer is stuck on the blocked session, then make its attempt fail (PostgreSQL: the
    connection is cut while it waits for the row; SQLite: it fails on its own, the database being locked)."""
    if db.kind == "sqlite":
        await wait_for(lambda: node.store.writer.retries >= 1)
        return
    waiting = "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'"
    async with asyncio.timeout(WAIT_S):
        while not await db.sql(waiting, app):
            await asyncio.sleep(0.02)
    await db.sql(f"SELECT pg_terminate_backend(pid) FROM ({waiting}) AS w", app)
    await wait_for(lambda: node.store.writer.retries >= 1)


async def test_a_write_retried_while_the_node_lost_the_session_and_claimed_it_back_is_refused(db: Db) -> None:
    """The report: a database stall, the node lets go of its sessions, rejoins and adopts them again at the next
    epoch; the batch it was retrying all along must not land then."""
    app = f"sbtest-{uuid.uuid4().hex[:8]}"
    a = await Node(db, "a", store=db.store(application_name=app, busy_timeout_ms=20)).start()
    await a.create("s1")
    await a.store.chat_store().commit("s1", Commit(items=[msg("before")]))

    blocker = Blocker(db)
    await blocker.hold("s1")
    try:
        late = asyncio.create_task(a.store.chat_store().commit("s1", Commit(items=[msg("late")])))  # made at epoch 1
        await batch_in_flight(db, a, app)
        # meanwhile the node let go of s1 and claimed it again (what a rejoin and the next adoption round do)
        a.fence.lose("s1", "lease not renewed in time")
        await blocker.execute("UPDATE sessions SET owner_node = 'a', owner_epoch = 2 WHERE id = 's1'")
        a.fence.claim("s1", 2)
    finally:
        await blocker.commit()
    with pytest.raises(SessionFenced) as refused:
        await late
    assert "not this node at epoch 1" in refused.value.detail
    await a.store.chat_store().commit("s1", Commit(items=[msg("after")]))  # made at epoch 2
    assert await items(db, "s1") == ["before", "after"]
    assert a.fence.epochs == {"s1": 2}  # the refused write of the old claim costs the new one nothing
    assert [sid for sid, _ in a.lost] == ["s1"]  # the loss the node itself reported, only


async def test_each_incarnation_writes_under_its_own_epoch(db: Db) -> None:
    a = await Node(db, "a").start()
    await a.create("s1")
    first = a.store.chat_store(1)
    await first.commit("s1", Commit(items=[msg("first")]))
    a.fence.lose("s1", "lease lost")
    await db.sql(db.q("UPDATE sessions SET owner_node = 'a', owner_epoch = 2 WHERE id = ?"), "s1")
    a.fence.claim("s1", 2)
    second = a.store.chat_store(2)
    with pytest.raises(SessionFenced):  # refused without a round trip: the node holds epoch 2 now
        await first.commit("s1", Commit(items=[msg("stale")]))
    with pytest.raises(SessionFenced):
        await a.store.event_sink(epoch=1).publish(_event("s1", 1))
    with pytest.raises(SessionFenced):
        await a.store.mark_session("s1", "failed", epoch=1)  # type: ignore[arg-type]
    await second.commit("s1", Commit(items=[msg("second")]))
    await a.store.event_sink(epoch=2).publish(_event("s1", 1))
    assert await items(db, "s1") == ["first", "second"]
    assert await db.sql("SELECT count(*) FROM events") == [(1,)]
    assert a.fence.owns("s1")


def _event(sid: str, seq: int) -> Event:
    return Event(session_id=sid, seq=seq, type="session.recovered", data={})


@asynccontextmanager
async def _write_connection(db: Db, node: Node) -> AsyncIterator[Any]:
    """A synchronous connection in a transaction, as the writer's: the batch is run on it with ``run``."""
    if db.kind == "sqlite":
        engine = sqlite_writer_engine(node.store.engine)
        try:
            with engine.connect() as conn, conn.begin():

                async def run_here(fn: Any, *args: Any) -> Any:
                    return fn(conn, *args)

                yield run_here
        finally:
            engine.dispose()
        return
    engine = sibling_engine(node.store.engine)
    try:
        async with engine.begin() as conn:

            async def run(fn: Any, *args: Any) -> Any:
                return await conn.run_sync(fn, *args)

            yield run
    finally:
        await engine.dispose()


async def test_a_batch_judges_each_write_on_its_own_epoch(db: Db) -> None:
    a = await Node(db, "a").start()
    await a.create("s1")
    await db.sql(db.q("UPDATE sessions SET owner_epoch = 2 WHERE id = ?"), "s1")  # claimed again by this node
    await a.store.create_session(SessionRecord(id="free", agent="demo", state="active"))
    await a.store.create_session(SessionRecord(id="theirs", agent="demo", state="active", owner_node="b"))
    loop = asyncio.get_running_loop()

    def op(sid: str, item: str, epoch: int | None) -> Op:
        return Op(sid, loop.create_future(), commit=Commit(items=[msg(item)]), epoch=epoch)

    old, new, free, theirs = op("s1", "old", 1), op("s1", "new", 2), op("free", "free", None), op("theirs", "x", 1)
    async with _write_connection(db, a) as run:
        _, refused, owners = await run(write_fenced, [old, new, free, theirs], {}, "a")
    assert set(refused) == {old, theirs}
    assert "owned by node a at epoch 2, not this node at epoch 1" in refused[old].detail
    assert owners["s1"] == ("a", 2) and owners["free"] == (None, 0)
    assert await items(db, "s1") == ["new"]
    assert await items(db, "free") == ["free"] and await items(db, "theirs") == []
