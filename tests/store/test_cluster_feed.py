"""ClusterFeed: the multi-session stream's feed in cluster mode gets every durable event in cursor order, once, however
events reach the node (out of order, some never, Redis down), filling gaps from the database (SQLite and PostgreSQL).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from switchboard.control.cluster.feed import ClusterFeed
from switchboard.control.hub import EventHub, Subscription
from switchboard.runtime.events import Event
from switchboard.store import Store
from switchboard.store.writes import EVENT_ORDER_LOCK_KEY

from .conftest import ON_POSTGRESQL, Db, pg_dsn

TIMEOUT_S = 15.0


@pytest.fixture
async def feed(store: Store) -> AsyncIterator[tuple[ClusterFeed, list[bool]]]:
    redis = [True]
    hub = EventHub()
    found = ClusterFeed(store, hub, redis_up=lambda: redis[0])
    await found.start()
    try:
        yield found, redis
    finally:
        await found.aclose()


async def _durable(store: Store, first: int, count: int) -> list[tuple[int, Event]]:
    """``count`` events of session s1 from seq ``first``, written as another node would (nobody told of them)."""
    seqs = range(first, first + count)
    events = [Event(session_id="s1", seq=seq, type="agent.state", data={"n": seq}) for seq in seqs]
    sink = store.event_sink()
    for event in events:
        await sink.publish(event)
    assert all(e.cursor for e in events)
    return [(int(e.cursor or 0), e) for e in events]


async def _received(sub: Subscription, count: int) -> list[tuple[int, int]]:
    """(cursor, seq) of the next ``count`` events of ``sub``."""
    out = []
    async with asyncio.timeout(TIMEOUT_S):
        for _ in range(count):
            cursor, event, _ = await sub.get()
            out.append((cursor, event.seq))
    return out


async def test_events_out_of_order_and_missing_reach_the_ordered_stream_in_cursor_order_once(
    store: Store, feed: tuple[ClusterFeed, list[bool]]
):
    cluster, _ = feed
    hub = cluster.hub
    ordered = hub.subscribe(ordered=True)
    session = hub.subscribe(session_ids=["s1"])
    await hub.in_order("s1")
    pairs = await _durable(store, 1, 5)
    # the node hears of 3 and 1 (Redis, its own writer), of 1 again, never of 2, 4 and 5
    hub.publish([pairs[2]])
    hub.publish([pairs[0], pairs[0]])
    got = await _received(ordered, 5)
    assert got == [(c, e.seq) for c, e in pairs]
    assert ordered.pending() == 0
    # the session streams get every event once, in seq order (what the feed read from the database, or the node's
    # session order filled from it)
    assert [e for _, e in await _received(session, 5)] == [1, 2, 3, 4, 5]
    assert cluster.repaired == 3
    hub.publish([pairs[1]])  # heard of late: already delivered
    await asyncio.sleep(0.3)
    assert ordered.pending() == 0
    assert session.pending() == 0


async def test_ids_that_were_never_committed_do_not_hold_the_stream(
    db: Db, store: Store, feed: tuple[ClusterFeed, list[bool]]
):
    """An id a failed or conflicting insert consumed never appears: once the database shows it missing below an
    event that is durable, the stream goes on past it."""
    cluster, _ = feed
    ordered = cluster.hub.subscribe(ordered=True)
    pairs = await _durable(store, 1, 3)
    await db.sql(db.q("DELETE FROM events WHERE id = ?"), pairs[1][0])  # as if never committed
    cluster.hub.publish([pairs[2]])
    assert await _received(ordered, 1) == [(pairs[0][0], 1)]
    assert await _received(ordered, 1) == [(pairs[2][0], 3)]
    assert cluster.last == pairs[2][0]


async def test_while_redis_is_down_other_nodes_events_are_read_from_the_database(
    store: Store, feed: tuple[ClusterFeed, list[bool]]
):
    cluster, redis = feed
    redis[0] = False
    ordered = cluster.hub.subscribe(ordered=True)
    session = cluster.hub.subscribe(session_ids=["s1"])
    await cluster.hub.in_order("s1")
    pairs = await _durable(store, 1, 4)  # nothing reaches this node: the feed polls
    expected = [(c, e.seq) for c, e in pairs]
    assert await _received(ordered, 4) == expected
    assert await _received(session, 4) == expected
    assert cluster.polls >= 1


@pytest.mark.postgres
@ON_POSTGRESQL
async def test_in_cluster_mode_event_ids_follow_commit_order(db: Db, store: Store):
    """Another node's transaction took an event id and has not committed: this node's events wait for it, so they
    get higher ids and commit after it. Without the lock the later id would commit first, and a stream resuming from
    it would skip the earlier one for good."""
    store.writer.ordered_events = True
    other = await asyncpg.connect(pg_dsn(), server_settings={"search_path": db.schema or "public"})
    try:
        tx = other.transaction()
        await tx.start()
        await other.execute("SELECT pg_advisory_xact_lock($1)", EVENT_ORDER_LOCK_KEY)
        first = await other.fetchval(
            "INSERT INTO events (session_id, seq, type, at, data) VALUES ('s1', 1, 'agent.state', now(), '{}')"
            " RETURNING id"
        )
        later = Event(session_id="s1", seq=2, type="agent.state", data={})
        publish = asyncio.ensure_future(store.event_sink().publish(later))
        await asyncio.sleep(0.5)
        assert not publish.done()  # waits for the other transaction
        await tx.commit()
        async with asyncio.timeout(TIMEOUT_S):
            await publish
    finally:
        await other.close()
    assert later.cursor is not None and later.cursor > first


async def test_a_cursor_the_database_never_reaches_does_not_freeze_the_stream(
    store: Store, feed: tuple[ClusterFeed, list[bool]]
):
    """A message is a hint: an event announced under a cursor the database does not hold (here far beyond anything
    durable) is dropped once a read does not find it, and the events that are durable keep flowing past it."""
    cluster, _ = feed
    ordered = cluster.hub.subscribe(ordered=True)
    forged = Event(session_id="ghost", seq=1, type="agent.state", data={"forged": True})
    cluster.hub.publish([(10**15, forged)])
    async with asyncio.timeout(TIMEOUT_S):
        while cluster._pending:  # the database was read: the announced event is gone (released, before the fix)
            await asyncio.sleep(0.01)
    pairs = await _durable(store, 1, 3)
    cluster.hub.publish(pairs)
    assert await _received(ordered, 3) == [(c, e.seq) for c, e in pairs]
    assert cluster.last == pairs[-1][0]
    assert cluster.discarded == 1
    await asyncio.sleep(0.3)
    assert ordered.pending() == 0


async def test_the_database_wins_over_a_message_that_says_otherwise(store: Store, feed: tuple[ClusterFeed, list[bool]]):
    """A message whose event differs from the database's row under its cursor does not take the real event's place:
    the read that fills the gap before it replaces it."""
    cluster, _ = feed
    ordered = cluster.hub.subscribe(ordered=True)
    pairs = await _durable(store, 1, 3)
    lie = Event(session_id="s1", seq=2, type="tool.ended", data={"forged": True})
    cluster.hub.publish([(pairs[1][0], lie), pairs[2]])  # the first one lost on the way, the second a lie
    got = []
    async with asyncio.timeout(TIMEOUT_S):
        for _ in range(3):
            cursor, event, _ = await ordered.get()
            got.append((cursor, event.seq, event.type, event.data))
    assert got == [(c, e.seq, e.type, e.data) for c, e in pairs]
    assert cluster.discarded == 1
