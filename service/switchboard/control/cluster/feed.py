"""ClusterFeed: in cluster mode, every node's durable events, in cursor order and none missing, for the multi-session
stream (``WS /v1/events``); and, while Redis is down, the other nodes' events for the session streams.

Events reach a node from its own writer and, through Redis, from the others': out of cursor order, and with gaps when
Redis loses some or is down. The database has them all, and in cluster mode event ids are assigned in commit order
(``store.writes.EVENT_ORDER_LOCK_KEY``): once an event is durable, every lower id is durable too or never will be (an
id a failed or conflicting insert consumed). So the feed releases events in cursor order as long as they follow each
other; at a gap it waits ``GAP_WAIT_S`` for Redis, then reads the database from the last released cursor: what it
finds fills the gap, and every id it does not find up to its last row is a hole. A message is only a hint: an event
held since before the read that the read does not find was never durable (a message that lied), and is dropped; the
database's row replaces an event a message announced differently. It also reads the database on its own, every
``POLL_S`` while Redis is unavailable (down, or not answering: that is how streams keep going without it, a little
late) and every ``SAFETY_POLL_S`` otherwise (a message Redis lost at the tail of a burst, with nothing after it to show
the gap).
An event read from the database that the node had not received goes to the session streams too, through the
hub's ``SessionOrder`` (``control.cluster.session_order``), which the feed installs: it puts each watched session's
events in ``seq`` order once per node, so that a session stream on any node sends them as on a single node.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ...runtime.aio import cancel_and_wait
from ...runtime.events import Event
from ...store import Store
from ..hub import EventHub
from .session_order import SessionOrder

logger = logging.getLogger("switchboard.control.cluster.feed")

GAP_WAIT_S = 0.2  # an event from another node is usually on its way through Redis
POLL_S = 0.5  # Redis down: how often the database is read for the other nodes' events
SAFETY_POLL_S = 2.0  # Redis up
PAGE = 500
PENDING_MAX = 100_000  # events held waiting for a gap to fill; past it the feed reads the database at once


class ClusterFeed:
    def __init__(self, store: Store, hub: EventHub, *, redis_up: Callable[[], bool]) -> None:
        self.store = store
        self.hub = hub
        self.redis_up = redis_up
        self.last = 0  # the highest cursor released
        self._pending: dict[int, Event] = {}
        self._gap_ev = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.order = SessionOrder(store, hub.deliver_sessions, hub.overflow_session)
        self.repaired = 0  # events read from the database that this node had not received
        self.discarded = 0  # events announced through Redis that the database does not hold as announced
        self.polls = 0

    async def start(self) -> None:
        self.last = await self.store.last_event_cursor()
        self.hub.ordered_by = self.offer
        self.hub.sequencer = self.order
        self._task = asyncio.create_task(self._run(), name="cluster-feed")

    async def aclose(self) -> None:
        self.hub.ordered_by = None
        self.hub.sequencer = None
        if self._task is not None:
            await cancel_and_wait(self._task)
        await self.order.aclose()

    def offer(self, events: list[tuple[int, Event]]) -> None:
        """Durable events, as they reach this node (its own, and the others' through Redis)."""
        for cursor, event in events:
            if cursor > self.last:
                self._pending.setdefault(cursor, event)
        self._release()
        if self._pending:
            self._gap_ev.set()

    def _release(self, through: int = 0) -> None:
        """Hand on the pending events that follow the last released one; with ``through``, every pending event up to
        it (the database showed that the ids missing below it are holes)."""
        out: list[tuple[int, Event]] = []
        pending = self._pending
        while pending:
            nxt = self.last + 1
            if nxt in pending:
                out.append((nxt, pending.pop(nxt)))
            elif through > self.last:
                lowest = min(pending)
                if lowest > through:
                    self.last = through
                    break
                out.append((lowest, pending.pop(lowest)))
                nxt = lowest
            else:
                break
            self.last = nxt
        if through > self.last:
            self.last = through
        if out:
            self.hub.publish_ordered(out)

    async def _run(self) -> None:
        while True:
            gap = await self._next_round()
            if gap and len(self._pending) < PENDING_MAX:
                await asyncio.sleep(GAP_WAIT_S)  # the missing events are probably on their way through Redis
            self._gap_ev.clear()
            if gap and not self._pending and self.redis_up():
                continue  # they came
            try:
                await self.catch_up()
            except Exception as err:  # the database is unavailable: the next round tries again
                logger.warning("cluster feed: cannot read events from the database (%r); will retry", err)

    async def _next_round(self) -> bool:
        """Wait for a gap (True), or until the database is due to be read without one (False): ``POLL_S`` while Redis
        is unavailable, ``SAFETY_POLL_S`` otherwise, looking every ``POLL_S`` (Redis may become unavailable
        meanwhile)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        while True:
            try:
                async with asyncio.timeout(POLL_S):
                    await self._gap_ev.wait()
                return True
            except TimeoutError:
                if not self.redis_up() or loop.time() - started >= SAFETY_POLL_S:
                    return False

    async def catch_up(self) -> None:
        """Read the database from the last released cursor: fill every gap, release everything it settles.

        The database decides, whatever messages said: it holds every event a node published (published only once
        durable), so an event held since before a read that the read does not find is not durable (a message that lied,
        or was not this cluster's), and one it finds under another session or ``seq`` is replaced by the database's."""
        self.polls += 1
        while True:
            held = set(self._pending)
            page = await self.store.events_multi(session_ids=None, since_id=self.last, limit=PAGE)
            full = len(page) == PAGE
            unseen = self._take(page)
            # the read covers every id up to its last row; and every id held before it, unless the page was full
            top = page[-1][0] if page else self.last
            self._drop_unfound({cursor for cursor, _ in page}, top, set() if full else held)
            if unseen:
                self.hub.publish_sessions(unseen)
            self._release(through=top)
            if not full:
                return

    def _take(self, page: list[tuple[int, Event]]) -> list[tuple[int, Event]]:
        """Hold the database's events in the place of what messages said under their cursors; return those this node
        had not received as they are (for the session streams)."""
        unseen: list[tuple[int, Event]] = []
        for cursor, event in page:
            mine = self._pending.get(cursor)
            if cursor <= self.last or (mine is not None and _same(mine, event)):
                continue
            if mine is None:
                self.repaired += 1
            else:
                self.discarded += 1
            unseen.append((cursor, event))
            self._pending[cursor] = event
        return unseen

    def _drop_unfound(self, found: set[int], top: int, held: set[int]) -> None:
        """Forget the held events a read showed are not durable: those up to ``top``, and those of ``held``, that it
        did not find."""
        wrong = [c for c in self._pending if c not in found and (c <= top or c in held)]
        for cursor in wrong:
            del self._pending[cursor]
        if wrong:
            self.discarded += len(wrong)
            logger.warning("cluster feed: %d event(s) announced through Redis are not in the database", len(wrong))


def _same(a: Event, b: Event) -> bool:
    return a.session_id == b.session_id and a.seq == b.seq and a.type == b.type and a.data == b.data
