"""Ownership with fencing: a node's writes for a session another node took over are refused inside the write's own
transaction; nothing of them lands, the other sessions of the same batch are written, and the loss is reported once."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
from dataclasses import replace
from datetime import timedelta

import pytest

from switchboard.runtime.chat import ChatMessage
from switchboard.runtime.events import Event
from switchboard.runtime.ports import Commit, SessionState
from switchboard.store import Fence, NodeMode, NodeRecord, NodeState, SessionFenced, SessionRecord, Store
from switchboard.store.records import now_utc

from .conftest import Db


def node(node_id: str, *, mode: NodeMode = NodeMode.CLUSTER, lease_s: float = 30.0, pid: int = 1) -> NodeRecord:
    now = now_utc()
    return NodeRecord(
        id=node_id,
        url=f"http://{node_id}",
        state=NodeState.LIVE,
        mode=mode,
        hostname="elsewhere",
        pid=pid,
        started_at=now,
        heartbeat_at=now,
        lease_until=now + timedelta(seconds=lease_s),
    )


def msg(item_id: str) -> ChatMessage:
    return ChatMessage(id=item_id, role="user", text=item_id)


class Node:
    """One node's view of the database: its own store, fenced with its own claims."""

    def __init__(self, db: Db, node_id: str, store: Store | None = None) -> None:
        self.id = node_id
        self.lost: list[tuple[str, str]] = []
        self.fence = Fence(node_id, on_fenced=lambda sid, why: self.lost.append((sid, why)))
        self.store: Store = store or db.store()

    async def start(self, *, lease_s: float = 30.0) -> Node:
        await self.store.migrate()
        assert await self.store.nodes.register(node(self.id, lease_s=lease_s), conflicts=lambda _: False) == []
        self.store.use_fence(self.fence)
        await self.store.start()
        return self

    async def create(self, sid: str) -> None:
        await self.store.create_session(
            SessionRecord(id=sid, agent="demo", state="active", owner_node=self.id, owner_epoch=1)
        )
        self.fence.claim(sid, 1)


async def items(db: Db, sid: str) -> list[str]:
    rows = await db.sql(db.q("SELECT item_id FROM chat_items WHERE session_id = ? ORDER BY pos"), sid)
    return [r[0] for r in rows]


async def owner(db: Db, sid: str) -> tuple[str, int]:
    ((who, epoch),) = await db.sql(db.q("SELECT owner_node, owner_epoch FROM sessions WHERE id = ?"), sid)
    return who, int(epoch)


async def expire(db: Db, node_id: str) -> None:
    await db.sql(db.q("UPDATE nodes SET lease_until = ? WHERE id = ?"), now_utc() - timedelta(seconds=1), node_id)


async def test_a_node_whose_session_was_taken_over_never_writes_for_it_again(db: Db) -> None:
    a = await Node(db, "a").start()
    await a.create("s1")
    await a.store.chat_store().commit("s1", Commit(items=[msg("before")]))
    b = await Node(db, "b").start()
    assert await b.store.nodes.claim_orphans("b") == {}  # a is live: nothing to take

    await expire(db, "a")
    assert await b.store.nodes.claim_orphans("b") == {"s1": 2}
    b.fence.claim("s1", 2)
    assert await owner(db, "s1") == ("b", 2)

    with pytest.raises(SessionFenced) as refused:
        await a.store.chat_store().commit("s1", Commit(items=[msg("late")], session=SessionState(agent="demo")))
    assert refused.value.session_id == "s1" and "owned by node b at epoch 2" in refused.value.detail
    assert a.lost == [("s1", refused.value.detail)]
    # later writes are refused without a round trip, events and state marks too; the loss is reported once
    with pytest.raises(SessionFenced):
        await a.store.chat_store().commit("s1", Commit(items=[msg("later")]))
    event = Event(session_id="s1", seq=1, type="session.started", data={})
    with pytest.raises(SessionFenced):
        await a.store.event_sink().publish(event)
    with pytest.raises(SessionFenced):
        await a.store.mark_session("s1", "failed")  # type: ignore[arg-type]
    assert len(a.lost) == 1 and a.fence.refusals == 4

    await b.store.chat_store().commit("s1", Commit(items=[msg("after")]))
    assert await items(db, "s1") == ["before", "after"]
    assert await db.sql("SELECT count(*) FROM events") == [(0,)]
    ((state,),) = await db.sql(db.q("SELECT state FROM sessions WHERE id = ?"), "s1")
    assert state == "active"


async def test_a_node_that_claims_a_session_back_appends_after_what_the_other_node_wrote(db: Db) -> None:
    a = await Node(db, "a").start()
    await a.create("s1")
    await a.store.chat_store().commit("s1", Commit(items=[msg("a1")]))  # a remembers the next position: 1
    b = await Node(db, "b").start()
    await db.sql(db.q("UPDATE sessions SET owner_node = 'b', owner_epoch = 2 WHERE id = ?"), "s1")
    b.fence.claim("s1", 2)
    await b.store.chat_store().commit("s1", Commit(items=[msg("b1"), msg("b2")]))
    await db.sql(db.q("UPDATE sessions SET owner_node = 'a', owner_epoch = 3 WHERE id = ?"), "s1")
    a.fence.claim("s1", 3)
    await a.store.chat_store().commit("s1", Commit(items=[msg("a2")]))  # not at position 1 again
    assert await items(db, "s1") == ["a1", "b1", "b2", "a2"]


async def test_a_batch_writes_the_sessions_still_owned_and_refuses_only_the_lost_one(db: Db) -> None:
    a = await Node(db, "a").start()
    for sid in ("s1", "s2"):
        await a.create(sid)
    # s1 is taken over behind a's back (its epoch moves on while a still believes it owns it)
    await db.sql(db.q("UPDATE sessions SET owner_node = ?, owner_epoch = 2 WHERE id = ?"), "b", "s1")
    chat = a.store.chat_store()
    results = await asyncio.gather(
        chat.commit("s1", Commit(items=[msg("x1")])),
        chat.commit("s2", Commit(items=[msg("x2")])),
        return_exceptions=True,
    )
    assert isinstance(results[0], SessionFenced) and results[1] is None
    assert await items(db, "s1") == [] and await items(db, "s2") == ["x2"]
    assert a.fence.owns("s2") and not a.fence.owns("s1")


async def test_a_session_no_node_claimed_is_written_only_while_unowned(db: Db) -> None:
    a = await Node(db, "a").start()
    await a.store.create_session(SessionRecord(id="free", agent="demo", state="active"))
    await a.store.chat_store().commit("free", Commit(items=[msg("m")]))  # nobody owns it: allowed
    await db.sql(db.q("UPDATE sessions SET owner_node = 'b', owner_epoch = 1 WHERE id = ?"), "free")
    with pytest.raises(SessionFenced):
        await a.store.chat_store().commit("free", Commit(items=[msg("n")]))
    assert await items(db, "free") == ["m"]


async def test_a_released_session_is_fenced_for_its_former_owner(db: Db) -> None:
    a = await Node(db, "a").start()
    await a.create("s1")
    a.fence.release("s1")  # closed here: a later write must not land
    with pytest.raises(SessionFenced):
        await a.store.chat_store().commit("s1", Commit(items=[msg("late")]))


async def test_registration_refuses_beside_a_conflicting_live_node_and_buries_expired_ones(db: Db) -> None:
    store = db.store()
    await store.migrate()
    nodes = store.nodes
    single = lambda other: True  # noqa: E731 - a single-node instance conflicts with any live node
    assert await nodes.register(node("first", mode=NodeMode.SINGLE), conflicts=single) == []
    blocking = await nodes.register(node("second", mode=NodeMode.SINGLE), conflicts=single)
    assert [n.id for n in blocking] == ["first"]
    assert [n.id for n in await nodes.list_nodes(states=[NodeState.LIVE])] == ["first"]
    # known gone (its process is not running): buried, and the second registers
    assert await nodes.register(node("second", mode=NodeMode.SINGLE), gone=["first"], conflicts=single) == []
    states = {n.id: n.state for n in await nodes.list_nodes()}
    assert states == {"first": NodeState.DEAD, "second": NodeState.LIVE}
    # a lease that passed buries its node too
    await expire(db, "second")
    assert await nodes.register(node("third", mode=NodeMode.SINGLE), conflicts=single) == []
    assert not await nodes.renew("second", 10.0)  # the buried node learns it on its next renewal
    assert await nodes.renew("third", 10.0)


async def test_claim_orphans_takes_a_share_when_nodes_split_a_dead_nodes_sessions(db: Db) -> None:
    store = db.store()
    await store.migrate()
    for nid in ("dead", "x", "y"):
        assert await store.nodes.register(node(nid), conflicts=lambda _: False) == []
    for i in range(5):
        await store.create_session(
            SessionRecord(id=f"s{i}", agent="demo", state="active", owner_node="dead", owner_epoch=3)
        )
    await store.create_session(SessionRecord(id="over", agent="demo", state="closed", owner_node="dead", owner_epoch=1))
    await expire(db, "dead")
    first = await store.nodes.claim_orphans("x", share=True)
    assert len(first) == 3 and set(first.values()) == {4}  # 5 orphans / 2 live nodes, rounded up
    second = await store.nodes.claim_orphans("y", share=True)
    assert set(second) == {f"s{i}" for i in range(5)} - set(first)
    assert await store.nodes.claim_orphans("x", share=True) == {}
    listed = {n.id: n.sessions for n in await store.nodes.list_nodes()}
    assert listed == {"x": 3, "y": 2, "dead": 0}


def test_this_hosts_dead_process_is_recognised() -> None:
    from switchboard.control.cluster.ownership import _process_gone

    here = socket.gethostname()
    mine = replace(node("me", pid=os.getpid()), hostname=here)
    assert _process_gone(mine, here)  # a container restarted with the same pid: the old process was this one
    assert not _process_gone(replace(mine, pid=os.getppid()), here)  # running
    with subprocess.Popen(["true"]) as child:
        child.wait()
    assert _process_gone(replace(mine, pid=child.pid), here)  # exited
    assert not _process_gone(replace(mine, hostname="elsewhere", pid=child.pid), here)  # another host: unknown


async def test_a_lease_is_set_and_judged_on_the_databases_clock_not_the_nodes(db: Db) -> None:
    """A node whose clock runs 1.6 s ahead registers and renews a 2 s lease: it lasts 2 s on the database's clock,
    and a node's lease is judged there (never 3.6 s, nor a healthy lease passed 0.4 s after its renewal)."""
    store = db.store()
    await store.migrate()
    skew = timedelta(seconds=1.6)
    fast = node("fast", lease_s=2.0)
    fast = replace(fast, started_at=fast.started_at + skew, heartbeat_at=fast.heartbeat_at + skew)
    fast = replace(fast, lease_until=fast.lease_until + skew)
    assert await store.nodes.register(fast, conflicts=lambda _: False) == []
    assert await store.nodes.register(node("ok", lease_s=2.0), conflicts=lambda _: False) == []
    left = await store.nodes.next_expiry_in("ok")
    assert left is not None and 0.5 < left <= 2.0
    assert await store.nodes.renew("fast", 2.0)
    listed = {n.id: n for n in await store.nodes.list_nodes()}
    assert listed["fast"].lease_left_s is not None and 0.5 < listed["fast"].lease_left_s <= 2.0
    assert listed["fast"].leased and listed["ok"].leased
    assert await store.nodes.live_url("ok") == "http://ok"
    await expire(db, "ok")
    assert await store.nodes.live_url("ok") is None
    assert not {n.id: n for n in await store.nodes.list_nodes()}["ok"].leased


async def test_a_node_whose_lease_passed_claims_nothing_and_buries_no_one(db: Db) -> None:
    """A claim sent while its node held its lease can run after the lease passed (the database stalled for longer):
    by then another node may be taking over this node's sessions, and anything it claimed would be run twice. Two
    nodes whose claims waited out a stall each took the other's sessions and ran them at once, before this."""
    store = db.store()
    await store.migrate()
    for nid in ("dead", "late", "other"):
        assert await store.nodes.register(node(nid), conflicts=lambda _: False) == []
    await store.create_session(SessionRecord(id="s0", agent="demo", state="active", owner_node="dead", owner_epoch=1))
    await store.create_session(SessionRecord(id="s1", agent="demo", state="active", owner_node="late", owner_epoch=1))
    await expire(db, "dead")
    await expire(db, "late")

    assert await store.nodes.claim_orphans("late") == {}
    assert await owner(db, "s0") == ("dead", 1)
    states = {n.id: n.state for n in await store.nodes.list_nodes()}
    assert states == {"dead": NodeState.LIVE, "late": NodeState.LIVE, "other": NodeState.LIVE}  # no one buried

    assert await store.nodes.claim_orphans("other") == {"s0": 2, "s1": 2}  # a node that holds its lease takes both
    # a buried node takes nothing either, even with a lease that has not passed
    await db.sql(db.q("UPDATE nodes SET lease_until = ? WHERE id = ?"), now_utc() + timedelta(seconds=30), "dead")
    await db.sql(db.q("UPDATE sessions SET owner_node = NULL WHERE id = ?"), "s1")
    assert await store.nodes.claim_orphans("dead") == {}
    assert await owner(db, "s1") == (None, 2)
