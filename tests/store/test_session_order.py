"""SessionOrder: in cluster mode a node puts each watched session's events in seq order once, for all of that
session's subscribers on the node: out of order, twice or missing as they reach it, every subscriber gets each event
once and in order, a gap is read from the database once per session (not once per subscriber), and a type filter is
applied by the hub as on a single node (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from switchboard.control.cluster.session_order import HELD_MAX, Item, SessionOrder
from switchboard.control.hub import EventHub, Subscription
from switchboard.runtime.events import Event
from switchboard.store import Store

TIMEOUT_S = 15.0


@pytest.fixture
async def hub(store: Store) -> AsyncIterator[EventHub]:
    found = EventHub()
    found.sequencer = SessionOrder(store, found.deliver_sessions, found.overflow_session)
    try:
        yield found
    finally:
        assert isinstance(found.sequencer, SessionOrder)
        await found.sequencer.aclose()


def _order(hub: EventHub) -> SessionOrder:
    assert isinstance(hub.sequencer, SessionOrder)
    return hub.sequencer


async def _durable(store: Store, sid: str, first: int, count: int, kind: str = "agent.state") -> list[Item]:
    """``count`` events of ``sid`` from seq ``first``, written as the session's owner would (nobody told of them)."""
    events = [Event(session_id=sid, seq=seq, type=kind, data={"n": seq}) for seq in range(first, first + count)]
    sink = store.event_sink()
    for event in events:
        await sink.publish(event)
    return [(int(e.cursor or 0), e) for e in events]


async def _seqs(sub: Subscription, count: int) -> list[int]:
    out = []
    async with asyncio.timeout(TIMEOUT_S):
        for _ in range(count):
            _, event, _ = await sub.get()
            out.append(event.seq)
    return out


async def test_every_subscriber_gets_each_event_once_in_order_and_a_gap_is_read_once_per_session(
    store: Store, hub: EventHub
):
    subs = [hub.subscribe(session_ids=["s1"]) for _ in range(50)]
    await hub.in_order("s1")
    pairs = await _durable(store, "s1", 1, 6)
    # heard of: 1, then 4 (2 and 3 lost by Redis), 1 again, 5, never 6
    hub.publish([pairs[0]])
    hub.publish([pairs[3], pairs[0]])
    hub.publish([pairs[4]])
    for sub in subs:
        assert await _seqs(sub, 6) == [1, 2, 3, 4, 5, 6]
    assert _order(hub).repairs == 1  # one database read for the fifty subscribers
    hub.publish([pairs[1], pairs[5]])  # heard of late: released already
    await asyncio.sleep(0.3)
    assert all(sub.pending() == 0 for sub in subs)


async def test_what_was_durable_before_the_first_subscriber_is_left_to_its_replay(store: Store, hub: EventHub):
    old = await _durable(store, "s1", 1, 3)
    sub = hub.subscribe(session_ids=["s1"])
    await hub.in_order("s1")
    new = await _durable(store, "s1", 4, 2)
    hub.publish([*old, *new])  # the first ones reach this node late (through Redis)
    assert await _seqs(sub, 2) == [4, 5]
    await asyncio.sleep(0.3)
    assert sub.pending() == 0
    assert _order(hub).repairs == 0


async def test_a_seq_the_database_never_got_does_not_hold_the_session(store: Store, hub: EventHub):
    """Below a durable event of a session, a seq missing from the database never comes (one writer commits a
    session's events in order; a node that lost the session is fenced)."""
    sub = hub.subscribe(session_ids=["s1"])
    await hub.in_order("s1")
    first = await _durable(store, "s1", 1, 1)
    later = await _durable(store, "s1", 3, 1)
    hub.publish([*first, *later])
    assert await _seqs(sub, 2) == [1, 3]


async def test_a_type_filter_is_applied_by_the_hub_and_the_end_of_the_session_still_reaches_the_stream(
    store: Store, hub: EventHub
):
    sub = hub.subscribe(session_ids=["s1"], types=["tool.progress", "session.closed"])
    await hub.in_order("s1")
    states = await _durable(store, "s1", 1, 2)
    progress = await _durable(store, "s1", 3, 2, kind="tool.progress")
    closed = await _durable(store, "s1", 5, 1, kind="session.closed")
    hub.publish([*progress, *closed])  # the agent.state events were lost on the way: read, and left out by the filter
    assert await _seqs(sub, 3) == [3, 4, 5]
    assert states and sub.pending() == 0


async def test_a_session_is_watched_while_it_has_subscribers(store: Store, hub: EventHub):
    order = _order(hub)
    first = hub.subscribe(session_ids=["s1"])
    second = hub.subscribe(session_ids=["s1"])
    await hub.in_order("s1")
    first.close()
    assert "s1" in order._tracks
    second.close()
    assert "s1" not in order._tracks
    hub.publish(await _durable(store, "s1", 1, 1))  # nobody listens: nothing held
    assert "s1" not in order._tracks


async def test_a_gap_that_holds_too_many_events_closes_the_session_streams_to_resume(store: Store, hub: EventHub):
    sub = hub.subscribe(session_ids=["s1"])
    await hub.in_order("s1")
    far = [(0, Event(session_id="s1", seq=seq, type="agent.state", data={})) for seq in range(3, HELD_MAX + 4)]
    hub.publish(far)  # never durable (so no repair can fill 1 and 2 in time): as if Redis had lost a long run
    assert sub.overflowed
    with pytest.raises(Exception, match="resume"):
        await sub.get()
    assert "s1" not in _order(hub)._tracks


async def test_a_subscriber_that_falls_behind_is_closed_to_resume_and_the_others_go_on(store: Store, hub: EventHub):
    slow = hub.subscribe(session_ids=["s1"], maxsize=2)
    other = hub.subscribe(session_ids=["s1"])
    await hub.in_order("s1")
    hub.publish(await _durable(store, "s1", 1, 4))
    assert slow.overflowed
    with pytest.raises(Exception, match="resume"):
        await slow.get()
    slow.close()
    assert await _seqs(other, 4) == [1, 2, 3, 4]
    hub.publish(await _durable(store, "s1", 5, 1))
    assert await _seqs(other, 1) == [5]


async def test_a_stream_waiting_for_the_first_read_ends_with_the_node(hub: EventHub):
    hub.subscribe(session_ids=["s1"])
    waiting = asyncio.ensure_future(hub.in_order("s1"))
    await asyncio.sleep(0)  # it waits
    await _order(hub).aclose()  # before the session's last seq was read
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(TIMEOUT_S):
            await waiting


async def test_a_seq_the_database_never_reaches_does_not_freeze_the_session(store: Store, hub: EventHub):
    """A message is a hint: an event announced under a seq the database does not hold (here far beyond the session's
    last) is dropped once a read does not find it, and the session's durable events keep flowing."""
    order = _order(hub)
    sub = hub.subscribe(session_ids=["s1"])
    await hub.in_order("s1")
    forged = Event(session_id="s1", seq=10**15, type="agent.state", data={"forged": True})
    hub.publish([(10**15, forged)])
    async with asyncio.timeout(TIMEOUT_S):
        while order._tracks["s1"].held:  # the database was read: the announced event is gone (released, before)
            await asyncio.sleep(0.01)
    hub.publish(await _durable(store, "s1", 1, 3))
    assert await _seqs(sub, 3) == [1, 2, 3]
    assert order.discarded == 1
    await asyncio.sleep(0.3)
    assert sub.pending() == 0


async def test_the_database_wins_over_a_message_that_says_otherwise(store: Store, hub: EventHub):
    """A message whose event differs from the database's row of that seq does not take the real event's place: the
    read that fills the gap before it replaces it (the real event is not dropped as a duplicate)."""
    sub = hub.subscribe(session_ids=["s1"])
    await hub.in_order("s1")
    pairs = await _durable(store, "s1", 1, 3)
    lie = Event(session_id="s1", seq=2, type="tool.ended", data={"forged": True})
    hub.publish([(pairs[1][0], lie), pairs[2]])  # the first one lost on the way, the second a lie
    got = []
    async with asyncio.timeout(TIMEOUT_S):
        for _ in range(3):
            _, event, _ = await sub.get()
            got.append((event.seq, event.type, event.data))
    assert got == [(e.seq, e.type, e.data) for _, e in pairs]
    assert _order(hub).discarded == 1


async def test_the_missing_events_that_arrive_behind_a_gap_release_it_at_once(store: Store, hub: EventHub):
    """The events a gap waits for, arriving late (through Redis, or from the session's previous owner), release
    what was held behind them at once, without a read."""
    sub = hub.subscribe(session_ids=["s1"])
    await hub.in_order("s1")
    pairs = await _durable(store, "s1", 1, 3)
    hub.publish([pairs[2]])
    hub.publish([pairs[0]])
    hub.publish([pairs[1]])
    assert sub.pending() == 3
    assert await _seqs(sub, 3) == [1, 2, 3]
    await asyncio.sleep(0.3)
    assert _order(hub).repairs == 0
