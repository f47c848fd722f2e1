"""A session lost and adopted again by the same node (a late lease renewal: the node lets go, rejoins and takes its
share back at the next epoch), on a real PostgreSQL: what the old incarnation still had under way when it was dropped
(the end of a call that cannot be cancelled) never lands; the new incarnation's recovery is the call's only end."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from switchboard import Agent, RunContext, function_tool
from switchboard.control.cluster.ownership import NodeLease
from switchboard.control.host import SessionHost
from switchboard.control.hub import EventHub
from switchboard.runtime.agent import AgentRegistry
from switchboard.runtime.ports import Commit
from switchboard.store import SessionRecord
from tests.waiting import WAIT_S

from .conftest import ON_POSTGRESQL, Db, pg_dsn
from .test_fencing import msg
from .test_lease import cluster_settings

pytestmark = [pytest.mark.timeout(60), ON_POSTGRESQL]

GATE: dict[str, asyncio.Event] = {}
APP = f"sbtest-{uuid.uuid4().hex[:8]}"  # the application name of the node's connections
WAITING = f"SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND application_name = '{APP}'"
LLM = {
    "provider": "scripted",
    "turns": [{"tool_calls": [{"name": "book", "arguments": {}, "id": "call-1"}]}],
    "fallback": {"text": "fine"},
}


class Booker(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You book.")

    @function_tool
    async def book(self, ctx: RunContext) -> str:
        """Cannot be cancelled; ends when the test lets it."""
        await GATE["release"].wait()
        return "booked"


@pytest.fixture
async def host(db: Db) -> AsyncIterator[SessionHost]:
    """Node ``a`` with session ``s1`` of a node that died, to adopt, and ``other``, a session no node runs."""
    GATE["release"] = asyncio.Event()
    store = db.store(application_name=APP)
    await store.migrate()
    settings = cluster_settings(db, "a", lease_s=10.0)
    lease = NodeLease(store, settings)
    await lease.start()
    await store.start()
    config = {"agent": "booker", "llm": LLM}
    await store.create_session(
        SessionRecord(id="s1", agent="booker", state="active", config=config, owner_node="gone", owner_epoch=1)
    )
    await store.create_session(SessionRecord(id="other", agent="booker", state="closed"))
    host = SessionHost(
        store=store, registry=AgentRegistry({"booker": Booker}), hub=EventHub(), settings=settings, lease=lease
    )
    try:
        yield host
    finally:
        GATE["release"].set()
        await host.aclose()
        await lease.aclose()


async def until_sql(db: Db, statement: str, expected: list[tuple[object, ...]]) -> None:
    async with asyncio.timeout(WAIT_S):
        while await db.sql(statement) != expected:
            await asyncio.sleep(0.02)


async def test_the_old_incarnations_late_tool_end_is_refused_and_recovery_is_the_only_end(
    db: Db, host: SessionHost
) -> None:
    lease = host.lease
    assert lease is not None
    await host.recover_all()
    first = host.sessions["s1"]
    assert lease.fence.epochs == {"s1": 2}
    await first.input("book it")
    await until_sql(db, "SELECT status FROM tool_calls WHERE session_id = 's1'", [("running",)])

    # the writer is held up (a batch of another session waits for its row), so that the call's end stays queued
    blocker = await asyncpg.connect(pg_dsn(), server_settings={"search_path": db.schema or "public"})
    try:
        async with blocker.transaction():
            await blocker.execute("SELECT 1 FROM sessions WHERE id = 'other' FOR UPDATE")
            held_up = asyncio.create_task(host.store.chat_store().commit("other", Commit(items=[msg("o1")])))
            waiting = (
                f"SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND application_name = '{APP}'"
            )
            await until_sql(db, waiting, [(1,)])
            GATE["release"].set()  # the call ends in the old incarnation: its pair and its end are queued
            await asyncio.sleep(0)
            async with asyncio.timeout(WAIT_S):
                while host.store.writer.pending == 0:
                    await asyncio.sleep(0.01)
            # the node lets go of s1 (its renewals came too late) and rejoins: s1 is an orphan again ...
            lease.fence.lose("s1", "lease not renewed in time")
            await db.sql("UPDATE sessions SET owner_node = NULL WHERE id = 's1'")
            # ... and the node's next adoption round takes it back at the next epoch and recovers it
            recovery = asyncio.create_task(host.recover_all())
            async with asyncio.timeout(WAIT_S):
                while host.sessions.get("s1") in (None, first):
                    await asyncio.sleep(0.01)
            assert lease.fence.epochs == {"s1": 3}
        await held_up
        await recovery
    finally:
        await blocker.close()
    await asyncio.gather(*host._drops)  # the old incarnation is gone, and what it had under way settled
    for session in list(host.sessions.values()):
        await session.events.flushed()

    outputs = await db.sql(
        "SELECT data->>'output' FROM chat_items WHERE session_id = 's1' AND type = 'function_call_output'"
    )
    assert len(outputs) == 1 and "booked" not in str(outputs[0][0])
    assert await db.sql("SELECT status FROM tool_calls WHERE session_id = 's1'") == [("interrupted",)]
    ended = await db.sql("SELECT data->>'status' FROM events WHERE session_id = 's1' AND type = 'tool.ended'")
    assert ended == [("interrupted",)]
    assert host.sessions["s1"] is not first and lease.fence.epochs == {"s1": 3}
    assert lease.fence.refusals >= 1
