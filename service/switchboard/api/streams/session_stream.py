"""A session stream: one session's events after ``since``, replayed from the store, then live, for one client (a
WebSocket, an SSE response), each exactly once and in ``seq`` order.

The hub subscription starts before the replay query, so the replay and the live events overlap: an event that became
durable before the replay read it may reach the hub after (the store's writer publishes once its commit returns, a
node hears another's events through Redis, a gap is filled from the database later).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable

from ...control.hub import EventHub, Subscription
from ...runtime.events import Event, type_matcher
from ...store import Store
from .direct_send import DirectSend

# a page of replayed events is held until sent: a slow reader of a large session holds one page, not its history
REPLAY_PAGE = 100
TERMINAL_EVENTS = ("session.closed", "session.failed")  # nothing follows them: a session stream then ends

LogItem = tuple[Event, str | None]


async def session_log(
    store: Store,
    sub: Subscription,
    sid: str,
    since: int,
    types: list[str] | None,
    ended: bool,
    *,
    heartbeat_s: float | None = None,
) -> AsyncGenerator[LogItem | None, None]:
    """One session's events after ``since``: replayed from the store, then live from ``sub`` (subscribed before the
    replay began, its events in order and none missing: in cluster mode ``control.cluster.session_order`` sees to it
    once per node), each exactly once and in order, until its terminal event. Live ones come with their JSON. With
    ``heartbeat_s``, yields None after that long without an event. Raises ``SubscriberOverflow`` when ``sub`` fell
    behind. ``ended``: the session had ended when ``sub`` was made (its terminal event is in the store)."""
    last = since
    while True:  # replay what is stored
        page = await store.events(sid, since=last, limit=REPLAY_PAGE, types=types)
        for event in page:
            yield event, None
            last = event.seq
            if event.type in TERMINAL_EVENTS:
                return
        if len(page) < REPLAY_PAGE:
            break
    if ended:
        return
    matches = type_matcher(types)
    while True:  # then live
        if heartbeat_s is None:  # the common case, without a timer per event per subscriber
            _, event, text = await sub.get()
        else:
            try:
                async with asyncio.timeout(heartbeat_s):
                    _, event, text = await sub.get()  # cancel-safe: an event is taken only once the wait is over
            except TimeoutError:
                yield None
                continue
        if event.seq <= last:
            continue
        if matches(event.type):
            yield event, text
        last = event.seq
        if event.type in TERMINAL_EVENTS:
            return


async def open_session_log(
    hub: EventHub,
    store: Store,
    sid: str,
    since: int,
    types: list[str] | None,
    *,
    maxsize: int,
    has_ended: Callable[[], Awaitable[bool]],
    heartbeat_s: float | None = None,
) -> tuple[Subscription, AsyncGenerator[LogItem | None, None]]:
    """Subscribe to ``sid``'s live events, then make its gap-free log after ``since`` (``session_log``).
    ``has_ended``: whether the session has ended (its terminal event durable)."""
    # the end of the session is seen even when the filter leaves its event out
    hub_types = None if types is None else [*types, *TERMINAL_EVENTS]
    sub = hub.subscribe(session_ids=[sid], types=hub_types, maxsize=maxsize)
    try:
        await hub.in_order(sid)  # cluster mode: the session's live events are in order from here on
        # checked after subscribing: a session that ends later reports it through the hub; one that has ended has its
        # terminal event durable already (host.close() returns only after that), so the replay has all of it
        ended = await has_ended()
    except BaseException:
        sub.close()
        raise
    log = session_log(store, sub, sid, since, types, ended, heartbeat_s=heartbeat_s)
    return sub, log


async def pump_log(
    log: AsyncGenerator[LogItem | None, None],
    direct: DirectSend,
    *,
    keepalive: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Send ``log``'s events that ``direct`` did not send from the hub's publish, until the session ends; on a
    heartbeat (None), ``keepalive``."""
    try:
        async with contextlib.aclosing(log):
            async for item in log:
                if item is None:
                    if keepalive is not None:
                        await direct.settled()
                        await keepalive()
                    continue
                await direct.send(*item)
    finally:
        await direct.aclose()
