"""A session stream sends each seq once, strictly increasing, none missing, whatever the order in which its replay
from the database, the hub, Redis and the database's gap fill deliver the events (I6): on a single node and in
cluster mode, where a node's ``SessionOrder`` puts each session's events in order (SQLite and PostgreSQL).

The stream is the real one (``session_stream``: subscription, replay, pump and direct send) writing to a socket that
records what a client would get."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator, Callable

import pytest

from switchboard.api.streams.direct_send import DirectSend
from switchboard.api.streams.session_stream import TERMINAL_EVENTS, open_session_log, pump_log
from switchboard.control.cluster import feed as cluster_feed
from switchboard.control.cluster import session_order
from switchboard.control.cluster.feed import ClusterFeed
from switchboard.control.cluster.session_order import SessionOrder
from switchboard.control.hub import EventHub, Subscription
from switchboard.runtime.events import Event
from switchboard.store import SessionRecord, Store

from .conftest import wait_for

TIMEOUT_S = 15.0
Pair = tuple[int, Event]


class Socket:
    """A client's socket: the seqs it got, in order. While ``open_ev`` is clear its buffer is full (sends wait)."""

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.open_ev = asyncio.Event()
        self.open_ev.set()

    async def send_text(self, text: str) -> None:
        await self.open_ev.wait()
        self.seqs.append(json.loads(text)["seq"])


class Clock:
    since: float | None = None


class Stream:
    """One connection of a session stream."""

    def __init__(self, sub: Subscription, since: int, socket: Socket) -> None:
        self.sub, self.since, self.socket = sub, since, socket
        self.started_ev = asyncio.Event()  # the pump runs (its replay first) once it is set
        self.task: asyncio.Task[None]

    def start(self) -> None:
        self.started_ev.set()

    @property
    def seqs(self) -> list[int]:
        return self.socket.seqs

    def idle(self) -> bool:
        """The replay is sent and the pump waits for live events (which the hub's publish now sends itself)."""
        return self.sub._waiting and not self.task.done()

    async def aclose(self) -> None:
        self.socket.open_ev.set()
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.sub.close()


async def _open(hub: EventHub, store: Store, sid: str, since: int, *, start: bool = True) -> Stream:
    socket = Socket()
    sub, log = await open_session_log(hub, store, sid, since, None, maxsize=100_000, has_ended=_live)

    def frames(event: Event, text: str | None) -> list[str]:
        return [text or event.model_dump_json()]

    direct = DirectSend(socket.send_text, sub, frames, [since], Clock(), TERMINAL_EVENTS)
    sub.direct = direct
    stream = Stream(sub, since, socket)

    async def pump() -> None:
        await stream.started_ev.wait()
        await pump_log(log, direct)

    stream.task = asyncio.create_task(pump(), name="test-stream")
    if start:
        stream.start()
    return stream


async def _live() -> bool:
    return False


async def _durable(store: Store, sid: str, first: int, count: int, kind: str = "agent.state") -> list[Pair]:
    """``count`` events of ``sid`` from seq ``first``, committed as the session's owner would; nobody is told."""
    events = [Event(session_id=sid, seq=seq, type=kind, data={"n": seq}) for seq in range(first, first + count)]
    sink = store.event_sink()
    for event in events:
        await sink.publish(event)
    return [(int(e.cursor or 0), e) for e in events]


@pytest.fixture(params=["single", "cluster"])
async def hub(request: pytest.FixtureRequest, store: Store) -> AsyncIterator[EventHub]:
    """A node's hub: alone on its database, or in cluster mode with its session order (which puts each session's
    events in order for the session streams; nothing else reads the database on its own here)."""
    found = EventHub()
    if request.param == "single":
        yield found
        return
    order = found.sequencer = SessionOrder(store, found.deliver_sessions, found.overflow_session)
    try:
        yield found
    finally:
        await order.aclose()


async def _until(predicate: Callable[[], bool]) -> None:
    await wait_for(predicate, TIMEOUT_S)


async def test_an_event_the_replay_read_before_the_hub_got_it_is_sent_once(store: Store, hub: EventHub):
    """The failure seen as ``[1, 2, 3, 4, 5, 4, 5, 6, ...]``: events 4 and 5 are durable when the stream's replay
    reads them, but reach the hub only after the stream went live (its node's writer publishes once its commit
    returns; another node's events come through Redis)."""
    await _durable(store, "s1", 1, 3)
    stream = await _open(hub, store, "s1", 0, start=False)  # subscribed; in cluster mode, seq 3 read as the last
    try:
        late = await _durable(store, "s1", 4, 2)
        stream.start()
        await _until(lambda: stream.idle() and len(stream.seqs) == 5)
        hub.publish(late)  # sent from the publish: the pump waits idle
        hub.publish(await _durable(store, "s1", 6, 1))
        await _until(lambda: 6 in stream.seqs)
        assert stream.seqs == [1, 2, 3, 4, 5, 6]
    finally:
        await stream.aclose()


@pytest.mark.parametrize("hub", ["cluster"], indirect=True)
async def test_a_gap_filled_after_a_stream_replayed_past_it_is_not_sent_again(
    store: Store, hub: EventHub, monkeypatch: pytest.MonkeyPatch
):
    """The failure seen as ``115, 116, 109, 110``: the node holds a session's events behind a gap (Redis lost two);
    a stream that opens meanwhile replays past the gap from the database; then the gap is filled (here by the late
    messages; a read from the database does the same) and every held event is released to the streams."""
    monkeypatch.setattr(session_order, "GAP_WAIT_S", 3600.0)  # the gap fills when the test says so
    watcher = await _open(hub, store, "s1", 0)
    stream: Stream | None = None
    try:
        pairs = await _durable(store, "s1", 1, 8)
        hub.publish(pairs[:2])
        hub.publish(pairs[4:])  # 3 and 4 on their way: 5 to 8 are held
        stream = await _open(hub, store, "s1", 2)
        await _until(lambda: stream is not None and stream.idle() and len(stream.seqs) == 6)
        hub.publish(pairs[2:4])
        await _until(lambda: len(watcher.seqs) == 8)
        hub.publish(await _durable(store, "s1", 9, 1))
        await _until(lambda: stream is not None and 9 in stream.seqs)
        assert stream.seqs == [3, 4, 5, 6, 7, 8, 9]
        assert watcher.seqs == list(range(1, 10))
    finally:
        await watcher.aclose()
        if stream is not None:
            await stream.aclose()


SCHEDULES = 12
STEPS = 40


async def test_streams_opened_at_any_point_of_any_delivery_schedule_get_each_seq_once_in_order(
    store: Store, monkeypatch: pytest.MonkeyPatch
):
    """Seeded schedules on a cluster node: events committed in bursts reach the node late, twice, out of order or
    never (Redis), the database is read on its own (Redis down) and gaps fill after a short wait, sockets fill up and
    drain, and streams open at any moment from any ``since`` and are cut. Every connection gets exactly the seqs after
    its ``since``, in order (a cut one a prefix of them)."""
    monkeypatch.setattr(session_order, "GAP_WAIT_S", 0.005)
    monkeypatch.setattr(cluster_feed, "GAP_WAIT_S", 0.005)
    hub = EventHub()
    feed = ClusterFeed(store, hub, redis_up=lambda: True)
    await feed.start()
    try:
        for seed in range(SCHEDULES):
            await _schedule(store, hub, feed, random.Random(seed), f"sim{seed}")
    finally:
        await feed.aclose()


async def _schedule(store: Store, hub: EventHub, feed: ClusterFeed, rng: random.Random, sid: str) -> None:
    await store.create_session(SessionRecord(id=sid, agent="demo", state="active"))
    durable = 0
    on_the_way: list[Pair] = []  # durable, not yet heard of by this node
    streams: list[Stream] = []
    done: list[Stream] = []
    try:
        for _ in range(STEPS):
            action = rng.random()
            if action < 0.25:  # a commit; Redis loses some of its events
                count = rng.randint(1, 4)
                pairs = await _durable(store, sid, durable + 1, count)
                durable += count
                on_the_way += [p for p in pairs if rng.random() > 0.15]
            elif action < 0.5 and on_the_way:  # some messages arrive, in any order, some twice
                rng.shuffle(on_the_way)
                cut = rng.randint(1, len(on_the_way))
                heard, on_the_way = on_the_way[:cut], on_the_way[cut:]
                hub.publish(heard)
                on_the_way += [p for p in heard if rng.random() < 0.2]
            elif action < 0.62 and len(streams) < 4:
                streams.append(await _open(hub, store, sid, rng.randint(0, durable)))
            elif action < 0.7 and streams:  # a client goes away
                stream = streams.pop(rng.randrange(len(streams)))
                await stream.aclose()
                done.append(stream)
            elif action < 0.78 and streams:
                socket = rng.choice(streams).socket
                socket.open_ev.clear() if socket.open_ev.is_set() else socket.open_ev.set()
            elif action < 0.84:
                await feed.catch_up()  # the database read on its own (Redis down, or a safety poll)
            else:
                await asyncio.sleep(rng.choice([0, 0, 0.001, 0.01]))
        for stream in streams:
            stream.socket.open_ev.set()
        end = await _durable(store, sid, durable + 1, 1, kind="session.closed")
        hub.publish([*on_the_way, *end])
        async with asyncio.timeout(TIMEOUT_S):
            await asyncio.gather(*(s.task for s in streams))
        last = durable + 1
        for stream in streams:
            assert stream.seqs == list(range(stream.since + 1, last + 1)), (sid, stream.since)
        for stream in done:
            assert stream.seqs == list(range(stream.since + 1, stream.since + 1 + len(stream.seqs))), (
                sid,
                stream.since,
            )
    finally:
        for stream in streams:
            await stream.aclose()
