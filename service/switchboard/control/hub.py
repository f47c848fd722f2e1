"""EventHub: in-process fan-out of durable events to live subscribers, with bounded buffers.

A subscriber that cannot keep up is not allowed to grow memory without bound: once its buffer is full it is marked
as overflowed and the WebSocket layer closes it with the seq to resume from. Nothing is lost: the events are in the
store and a client resumes with ``since``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from typing import Protocol

from ..runtime.events import Event, type_matcher

Item = tuple[int, Event, str]  # (cursor, event, the event as JSON)


class SubscriberOverflow(Exception):
    def __init__(self, resume_from: int) -> None:
        super().__init__(f"subscriber fell behind; resume from seq {resume_from}")
        self.resume_from = resume_from


class Sequencer(Protocol):
    """``control.cluster.session_order.SessionOrder``: puts each watched session's events in order (cluster mode)."""

    def track(self, sid: str) -> Awaitable[None]: ...

    def forget(self, sid: str) -> None: ...

    def offer(self, events: list[tuple[int, Event]]) -> None: ...


class Subscription:
    def __init__(
        self,
        hub: EventHub,
        *,
        session_ids: frozenset[str] | None,
        types: Iterable[str] | None,
        maxsize: int,
    ) -> None:
        self._hub = hub
        self.session_ids = session_ids
        # an ordered (multi-session) subscription with a session filter: it is offered every event, in cursor order
        self.only: frozenset[str] | None = None
        self._matches: Callable[[str], bool] = type_matcher(types)
        self._filtered = any(p.strip() for p in types or ())  # False: every type (no per-publish filtering)
        self._buffer: deque[Item] = deque()
        self.overflow_ev = asyncio.Event()
        self._maxsize = maxsize
        self._ready = asyncio.Event()
        self.overflowed = False
        self.closed = False
        #: A stream that can send events at once sets this: offered the live events of each publish (in order) while
        #: its reader waits idle in ``get``, it returns how many of them it has taken, from the first (no task wakes
        #: for them; a stream can write them together); the rest are buffered.
        self.direct: Callable[[Sequence[Item]], int] | None = None
        self.error: BaseException | None = None  # raised by ``get``: the stream's direct send failed
        self._waiting = False

    def matches(self, event_type: str) -> bool:
        """Whether this subscription's type filter takes events of ``event_type``."""
        return self._matches(event_type)

    def _offer(self, items: Sequence[Item]) -> None:
        """Take the events of one publish, in order (those this subscription wants)."""
        if self.overflowed or self.closed:
            return
        only, matches = self.only, self._matches
        mine = (
            [it for it in items if matches(it[1].type) and (only is None or it[1].session_id in only)]
            if self._filtered or only is not None
            else items  # the common case (an AG-UI stream, a dashboard): no list per subscriber per publish
        )
        if not mine:
            return
        if self.direct is not None and self._waiting and not self._buffer:
            taken = self.direct(mine)
            if taken == len(mine):
                return
            mine = mine[taken:]
        if len(self._buffer) + len(mine) > self._maxsize:
            self.overflow()
        else:
            self._buffer.extend(mine)
        self._ready.set()

    def overflow(self) -> None:
        """Mark the subscription as fallen behind: its stream is closed (4008) and resumes from the store."""
        if not self.overflowed:
            self.overflowed = True
            self._hub.dropped_subscribers += 1
        self._buffer.clear()
        self.overflow_ev.set()
        self._ready.set()

    async def get(self) -> Item:
        """Next (cursor, event, event as JSON). Raises ``SubscriberOverflow`` once the buffer overflowed."""
        while not self._buffer:
            if self.overflowed:
                raise SubscriberOverflow(-1)
            if self.error is not None:
                raise self.error
            self._ready.clear()
            self._waiting = True
            try:
                await self._ready.wait()
            finally:
                self._waiting = False
        if self.overflowed:
            raise SubscriberOverflow(-1)
        return self._buffer.popleft()

    def fail(self, error: BaseException) -> None:
        """End the reader's wait with ``error`` (its direct send failed)."""
        self.error = error
        self._ready.set()

    def pending(self) -> int:
        return len(self._buffer)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._hub._remove(self)
            self._ready.set()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EventHub:
    """Session subscriptions get a session's events as they become durable (here or, in cluster mode, on another
    node); ordered subscriptions (the multi-session stream) get every session's events in cursor order.

    One node commits its events in cursor order, so ``publish`` feeds both. In cluster mode events reach a node from
    several writers, out of cursor order and with gaps: ``ordered_by`` (``control.cluster.feed``) then puts them in
    cursor order, filling gaps from the database, and hands them back through ``publish_ordered``; ``sequencer``
    (``control.cluster.session_order``) puts each watched session's events in ``seq`` order, once per node, for the
    session subscriptions."""

    def __init__(self, *, default_buffer: int = 1000) -> None:
        self.default_buffer = default_buffer
        self._by_session: dict[str, set[Subscription]] = {}
        self._global: set[Subscription] = set()
        self.dropped_subscribers = 0
        self.ordered_by: Callable[[list[tuple[int, Event]]], None] | None = None
        self.sequencer: Sequencer | None = None

    @property
    def subscriber_count(self) -> int:
        return len(self._global) + sum(len(s) for s in self._by_session.values())

    def subscribe(
        self,
        *,
        session_ids: Iterable[str] | None = None,
        types: Iterable[str] | None = None,
        maxsize: int | None = None,
        ordered: bool = False,
    ) -> Subscription:
        """``ordered``: every matching event (of ``session_ids`` if given) in cursor order, for the multi-session
        stream; otherwise the events of ``session_ids`` (None: all) as they become durable."""
        ids = frozenset(session_ids) if session_ids is not None else None
        size = maxsize or self.default_buffer
        sub = Subscription(self, session_ids=None if ordered else ids, types=types, maxsize=size)
        if ordered:
            sub.only = ids
            self._global.add(sub)
        elif ids is None:
            self._global.add(sub)
        else:
            for sid in ids:
                self._by_session.setdefault(sid, set()).add(sub)
                if self.sequencer is not None:
                    self.sequencer.track(sid)
        return sub

    async def in_order(self, sid: str) -> None:
        """Wait until ``sid``'s live events reach its subscriptions in order, none missing (at once but in cluster
        mode, where the session's last durable seq is read first: what a subscriber replays after this has every
        event up to where the live ones begin)."""
        if self.sequencer is not None and sid in self._by_session:
            await self.sequencer.track(sid)

    def overflow_session(self, sid: str) -> None:
        for sub in list(self._by_session.get(sid, ())):
            sub.overflow()

    def _remove(self, sub: Subscription) -> None:
        if sub.session_ids is None:
            self._global.discard(sub)
            return
        for sid in sub.session_ids:
            subs = self._by_session.get(sid)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._by_session[sid]
                    if self.sequencer is not None:
                        self.sequencer.forget(sid)

    def publish(self, events: Iterable[tuple[int, Event]]) -> None:
        """Deliver durable events (with their global cursor) to every matching subscriber, in order."""
        if self.ordered_by is None and self.sequencer is None:
            self._deliver(events, self._global)
            return
        events = list(events)
        self.publish_sessions(events)
        if self.ordered_by is not None:
            self.ordered_by(events)

    def publish_ordered(self, events: Iterable[tuple[int, Event]]) -> None:
        """Cluster mode: events in cursor order, for the ordered subscriptions."""
        if not self._global:
            return
        items = [(cursor, event, event.model_dump_json()) for cursor, event in events]
        for sub in self._global:
            sub._offer(items)

    def publish_sessions(self, events: Iterable[tuple[int, Event]]) -> None:
        """Cluster mode: events for the session subscriptions, as they reach this node (through ``sequencer``)."""
        if self.sequencer is None:
            self._deliver(events, ())
        else:
            self.sequencer.offer(list(events))

    def deliver_sessions(self, events: list[tuple[int, Event]]) -> None:
        """Events in order per session (from ``sequencer``), for the session subscriptions."""
        self._deliver(events, ())

    def _deliver(self, events: Iterable[tuple[int, Event]], others: Collection[Subscription]) -> None:
        """Offer each subscription the events of this publish it may want, together: a stream writes them at once."""
        by_session: dict[str, list[Item]] = {}
        everything: list[Item] = []
        for cursor, event in events:
            if not others and event.session_id not in self._by_session:
                continue
            # serialised once; one tuple shared by every subscriber (no per-subscriber allocation to collect)
            item = (cursor, event, event.model_dump_json())
            by_session.setdefault(event.session_id, []).append(item)
            if others:
                everything.append(item)
        for sid, items in by_session.items():
            for sub in self._by_session.get(sid, ()):
                sub._offer(items)
        if everything:
            for sub in others:
                sub._offer(everything)
