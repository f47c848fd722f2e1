"""A cluster node's lease against a real PostgreSQL: a node whose renewals are held up past the point where it lets go
of its sessions must hand them back to the cluster once it can write again, and a takeover in progress never holds
up the other nodes' renewals."""

from __future__ import annotations

import asyncio
import time

import asyncpg
import pytest

from switchboard.control.ownership import NodeLease
from switchboard.control.settings import Settings
from switchboard.store import NodeState, SessionRecord

from .conftest import ON_POSTGRESQL, Db, pg_dsn
from .test_fencing import node

pytestmark = pytest.mark.timeout(60)

LEASE_S = 2.0


def cluster_settings(db: Db, node_id: str) -> Settings:
    # cluster mode needs a Redis URL; the lease never talks to Redis
    return Settings(database_url=db.url, redis_url="redis://127.0.0.1:9/0", node_id=node_id, lease_s=LEASE_S)


async def owner(db: Db, sid: str) -> tuple[str | None, int]:
    ((who, epoch),) = await db.sql("SELECT owner_node, owner_epoch FROM sessions WHERE id = $1", sid)
    return who, int(epoch)


async def held_row(db: Db, node_id: str, hold_s: float) -> None:
    """Lock ``node_id``'s row for ``hold_s`` from a connection of its own: its renewals wait (a stalled database)."""
    conn = await asyncpg.connect(pg_dsn(), server_settings={"search_path": db.schema or "public"})
    try:
        async with conn.transaction():
            await conn.execute("SELECT 1 FROM nodes WHERE id = $1 FOR UPDATE", node_id)
            await asyncio.sleep(hold_s)
    finally:
        await conn.close()


async def started(db: Db, node_id: str) -> NodeLease:
    store = db.store()
    await store.migrate()
    await store.start()
    lease = NodeLease(store, cluster_settings(db, node_id))
    await lease.start()
    return lease


@ON_POSTGRESQL
async def test_a_node_that_let_go_after_late_renewals_hands_its_sessions_back(db: Db) -> None:
    lease = await started(db, "a")
    try:
        await lease.store.create_session(
            SessionRecord(id="s1", agent="demo", state="active", owner_node="a", owner_epoch=1)
        )
        lease.claim_new("s1")
        # renewals held up past 3/4 of the lease: the node lets go of s1 (it stops acting on it)
        await held_row(db, "a", LEASE_S * 0.9)
        async with asyncio.timeout(10):
            while lease.fence.owns("s1"):
                await asyncio.sleep(0.05)
        # once the database answers again, s1 must not stay named after a live node that no longer runs it: the
        # node rejoins as a fresh member, and s1 is an orphan any live node (this one too) takes over
        deadline = time.monotonic() + 10
        while (await owner(db, "s1"))[0] == "a" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert await owner(db, "s1") == (None, 1)
        assert await lease.claim_orphans() == {"s1": 2}
        assert lease.fence.owns("s1")
        nodes = {n.id: n for n in await lease.store.nodes.list_nodes()}
        assert nodes["a"].state == NodeState.LIVE and nodes["a"].sessions == 1
    finally:
        await lease.aclose()


@ON_POSTGRESQL
async def test_a_takeover_in_progress_does_not_hold_up_renewals(db: Db) -> None:
    """A takeover waits for the session rows a write batch holds; the renewals of every node go on meanwhile."""
    a = await started(db, "a")
    b = db.store()  # another node (another process: registered with another pid, on another host)
    assert await b.nodes.register(node("b"), conflicts=lambda _: False) == []
    try:
        await a.store.create_session(SessionRecord(id="s1", agent="demo", state="active", owner_node="gone"))
        conn = await asyncpg.connect(pg_dsn(), server_settings={"search_path": db.schema or "public"})
        try:
            async with conn.transaction():
                await conn.execute("SELECT 1 FROM sessions WHERE id = 's1' FOR UPDATE")  # a write batch in flight
                claim = asyncio.create_task(b.nodes.claim_orphans("b", share=True))
                await asyncio.sleep(0.3)
                assert not claim.done()  # waiting for the session row
                async with asyncio.timeout(LEASE_S / 2):
                    assert await a.store.nodes.renew("a", LEASE_S)
            assert await claim == {"s1": 1}
        finally:
            await conn.close()
        assert a.renewals_failed == 0 and a.fence.epochs == {}
    finally:
        await a.aclose()


@ON_POSTGRESQL
async def test_adoption_looks_again_as_soon_as_another_nodes_lease_passes(db: Db) -> None:
    """A node that died is taken over once its lease has passed, not up to a polling interval later."""
    a = await started(db, "a")
    try:
        assert await a.next_adoption_in(5.0) == 5.0  # alone
        other = db.store()
        assert await other.nodes.register(node("b", lease_s=60.0), conflicts=lambda _: False) == []
        assert await a.next_adoption_in(5.0) == 5.0  # b's lease passes long after the interval
        assert await other.nodes.register(node("b", lease_s=1.0), conflicts=lambda _: False) == []
        assert 0.5 < await a.next_adoption_in(5.0) <= 1.1  # when b's lease passes (b stopped renewing)
        await db.sql("UPDATE nodes SET lease_until = lease_until - interval '2 seconds' WHERE id = 'b'")
        assert await a.next_adoption_in(5.0) == pytest.approx(0.05)  # passed already: look now (briefly after)
    finally:
        await a.aclose()
