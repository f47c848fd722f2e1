"""A cluster node's lease against a real PostgreSQL: a node whose renewals are held up past the point where it lets go
of its sessions must hand them back to the cluster once it can write again, a takeover in progress never holds
up the other nodes' renewals, and an event loop that stalls for a while does not cost the node its lease (renewals go
on from a thread of their own) while one that stays stuck does."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta

import asyncpg
import pytest

from switchboard.control.cluster.ownership import NodeDraining, NodeLease
from switchboard.control.settings import Settings
from switchboard.store import NodeState, SessionRecord
from switchboard.store.records import now_utc

from ..waiting import WAIT_S, until
from .conftest import ON_POSTGRESQL, Db, pg_dsn
from .test_fencing import node

pytestmark = pytest.mark.timeout(60)

LEASE_S = 2.0


def cluster_settings(db: Db, node_id: str, lease_s: float = LEASE_S) -> Settings:
    # cluster mode needs a Redis URL; the lease never talks to Redis
    return Settings(database_url=db.url, redis_url="redis://127.0.0.1:9/0", node_id=node_id, lease_s=lease_s)


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


async def started(db: Db, node_id: str, lease_s: float = LEASE_S) -> NodeLease:
    store = db.store()
    await store.migrate()
    await store.start()
    lease = NodeLease(store, cluster_settings(db, node_id, lease_s))
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
        async with asyncio.timeout(WAIT_S):
            while lease.fence.owns("s1"):
                await asyncio.sleep(0.05)
        with pytest.raises(NodeDraining):  # until it rejoined, a session it created would be let go of at once
            lease.check_serving()
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


# A longer lease for the stalled-loop tests: renewals every 1 s, sent while the loop stamped within 2 s (the bound), and
# the node lets go after 3 s without one. Wide margins, for a loaded machine.
STALL_LEASE_S = 4.0


async def with_session(db: Db, node_id: str) -> NodeLease:
    lease = await started(db, node_id, STALL_LEASE_S)
    assert lease.stall_s == STALL_LEASE_S / 2
    await lease.store.create_session(
        SessionRecord(id="s1", agent="demo", state="active", owner_node=node_id, owner_epoch=1)
    )
    lease.claim_new("s1")
    await asyncio.sleep(0.3)  # the loop stamps its heartbeat
    return lease


def block_event_loop(db: Db, node_id: str, seconds: float) -> tuple[datetime, datetime, datetime]:
    """Run nothing else on the event loop for ``seconds`` (a long synchronous call). Returns when the block began, and
    the node's ``heartbeat_at`` and ``lease_until`` as they stand at its end (read from another thread, before the loop
    runs again)."""
    began = now_utc()
    time.sleep(seconds)
    ((heartbeat_at, lease_until),) = db.sql_sync("SELECT heartbeat_at, lease_until FROM nodes WHERE id = $1", node_id)
    return began, heartbeat_at, lease_until


@ON_POSTGRESQL
async def test_a_node_whose_event_loop_stalls_within_the_bound_renews_meanwhile(db: Db) -> None:
    lease = await with_session(db, "a")
    try:
        began, heartbeat_at, _ = block_event_loop(db, "a", lease.stall_s * 0.9)
        assert heartbeat_at > began + timedelta(seconds=0.5)  # renewed while the loop was blocked
        await asyncio.sleep(0.3)
        assert lease.fence.owns("s1") and lease.renewals_skipped == 0
    finally:
        await lease.aclose()


@ON_POSTGRESQL
async def test_a_loop_blocked_past_three_quarters_of_the_lease_keeps_it_thanks_to_renewals_within_the_bound(
    db: Db,
) -> None:
    """Renewed on the event loop, a node blocked this long let go of its sessions (nothing renewed it meanwhile); the
    renewals sent in the first ``stall_s`` of the block keep the lease valid past it."""
    lease = await with_session(db, "a")
    try:
        began, heartbeat_at, lease_until = block_event_loop(db, "a", STALL_LEASE_S * 0.75 + 0.3)
        assert heartbeat_at > began + timedelta(seconds=0.9) and lease_until > now_utc()
        await asyncio.sleep(0.3)
        assert lease.fence.owns("s1")
        assert await owner(db, "s1") == ("a", 1)
    finally:
        await lease.aclose()


@ON_POSTGRESQL
async def test_a_node_whose_event_loop_is_stuck_stops_renewing_and_loses_its_sessions(db: Db) -> None:
    lease = await with_session(db, "a")
    other = db.store()
    assert await other.nodes.register(node("b"), conflicts=lambda _: False) == []
    try:
        began, heartbeat_at, lease_until = block_event_loop(db, "a", lease.stall_s + STALL_LEASE_S * 0.75 + 1.0)
        # the renewal thread stopped once the loop had not run for stall_s: the lease passed during the block
        assert heartbeat_at <= began + timedelta(seconds=lease.stall_s + 0.2)
        assert lease_until < now_utc()
        # the first thing the loop does when it runs again is to let go of its sessions (it did not renew in time)
        await asyncio.sleep(0.2)
        assert not lease.fence.owns("s1") and lease.renewals_skipped > 0
        assert await other.nodes.claim_orphans("b") == {"s1": 2}
    finally:
        await lease.aclose()


async def test_a_claim_whose_answer_was_lost_is_settled_by_the_next_one(
    db: Db, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the claim committed, then the connection dropped before its answer came back: the database names this node the
    # owner of s1, no other node takes it (this node holds its lease), so this node must find it and run it (found by
    # the cluster simulation: a session owned by a live node that never ran it)
    lease = await started(db, "a")
    try:
        await lease.store.create_session(
            SessionRecord(id="s1", agent="demo", state="active", owner_node="gone", owner_epoch=1)
        )
        claim = lease.store.nodes.claim_orphans

        async def committed_then_reset(node_id: str, *, share: bool = False) -> dict[str, int]:
            await claim(node_id, share=share)
            raise ConnectionResetError("connection reset by peer")

        monkeypatch.setattr(lease.store.nodes, "claim_orphans", committed_then_reset)
        with pytest.raises(ConnectionResetError):
            await lease.claim_orphans()
        assert await owner(db, "s1") == ("a", 2) and not lease.fence.owns("s1")
        monkeypatch.setattr(lease.store.nodes, "claim_orphans", claim)
        assert await lease.claim_orphans() == {"s1": 2}
        assert lease.fence.epochs == {"s1": 2}
    finally:
        await lease.aclose()


async def test_a_claim_answered_after_the_node_had_to_stop_acting_runs_nothing_and_is_released(
    db: Db, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the claim ran while the node held its lease, but its answer came back once the node had gone three quarters of
    # its lease without a renewal: the others may take those sessions as soon as the lease passes, so the node must
    # not start running them; it rejoins, which hands them back to the cluster
    lease = await started(db, "a")
    try:
        await lease.store.create_session(
            SessionRecord(id="s1", agent="demo", state="active", owner_node="gone", owner_epoch=1)
        )
        claim = lease.store.nodes.claim_orphans

        async def answered_late(node_id: str, *, share: bool = False) -> dict[str, int]:
            claimed = await claim(node_id, share=share)
            lease._renewed_at = time.monotonic() - LEASE_S  # no renewal since: as if the answer took that long
            return claimed

        monkeypatch.setattr(lease.store.nodes, "claim_orphans", answered_late)
        assert await lease.claim_orphans() == {}
        assert not lease.fence.owns("s1")
        assert await owner(db, "s1") == ("a", 2)
        monkeypatch.setattr(lease.store.nodes, "claim_orphans", claim)
        await until(lambda: not lease._rejoin)  # the renewal thread registers it again: s1 is released
        assert await owner(db, "s1") == (None, 2)
        assert await lease.claim_orphans() == {"s1": 3}
    finally:
        await lease.aclose()
