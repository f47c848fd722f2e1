"""SessionOrder: in cluster mode, each watched session's events in ``seq`` order, none missing and none twice, once
per node for all of that session's subscribers on the node.

A node gets a session's events from its own writer when it owns the session and through Redis when another node
does: Redis may lose some, and when a session moves, its previous owner's last events can come after the new owner's
first ones. Rather than each subscriber checking its stream for gaps (one database read per subscriber per gap, and
every event of the session sent to every subscriber so that a missing ``seq`` can be told from a filtered one), the
node puts each watched session's events in order here, once: an event that follows the last released one is released
at once (the common case, no task wakes); one after a gap is held, and the gap is filled from the database after
``GAP_WAIT_S``. A ``seq`` the database does not have below a durable event of the same session never will: one
writer commits a session's events in order, and a node that lost the session is fenced before it writes again. Events
at or below the last released ``seq`` are dropped (the same event read from the database and then through Redis).
A message is only a hint: a held event the gap's read does not find was never durable (a message that lied) and is
dropped, and the database's row of a ``seq`` replaces what a message said of it, so no message moves a session past
what the database holds.

A session is watched while it has subscribers on this node. When its first subscriber comes, the session's last
durable ``seq`` is read (``track``): what is at or below it is in the subscriber's replay, which starts after that
read; everything after it is released here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ...runtime.aio import cancel_and_wait
from ...runtime.events import Event
from ...store import Store

logger = logging.getLogger("switchboard.control.cluster.session_order")

GAP_WAIT_S = 0.2  # a missing event is usually on its way (through Redis, or from a session's previous owner)
RETRY_MAX_S = 2.0  # the database is unavailable: retry the repair up to this often
PAGE = 500
HELD_MAX = 10_000  # events held behind one gap; past it the session's subscribers are closed (they resume by seq)

Item = tuple[int, Event]


class _Track:
    __slots__ = ("held", "next", "ready", "task")

    def __init__(self) -> None:
        self.next: int | None = None  # the next seq to release; None until the last durable seq is known
        self.held: dict[int, Item] = {}
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task[None] | None = None  # the first read, or a gap's repair


class SessionOrder:
    def __init__(
        self,
        store: Store,
        deliver: Callable[[list[Item]], None],
        overflow: Callable[[str], None],
    ) -> None:
        self.store = store
        self._deliver = deliver  # to the session subscriptions, in order
        self._overflow = overflow  # close a session's subscribers: a gap held too many events
        self._tracks: dict[str, _Track] = {}
        self.repaired = 0  # events read from the database to fill a gap
        self.discarded = 0  # events announced through Redis that the database does not hold as announced
        self.repairs = 0

    def track(self, sid: str) -> asyncio.Future[None]:
        """Watch ``sid``; the future is done once its events are released in order (raises if the first read
        failed: the caller's stream fails and the next subscriber tries again)."""
        track = self._tracks.get(sid)
        if track is None:
            track = self._tracks[sid] = _Track()
            track.task = asyncio.create_task(self._start(sid, track), name=f"order:{sid}")
        return track.ready

    def forget(self, sid: str) -> None:
        """``sid`` has no subscriber left on this node."""
        track = self._tracks.pop(sid, None)
        if track is None:
            return
        if track.task is not None:
            track.task.cancel()
        track.ready.cancel()  # a no-op once it is done

    async def aclose(self) -> None:
        tracks, self._tracks = list(self._tracks.values()), {}
        for track in tracks:
            track.ready.cancel()  # a stream still waiting for the first read ends with the node
        await cancel_and_wait(*(t.task for t in tracks))

    def offer(self, events: list[Item]) -> None:
        """Durable events, as they reach this node; those of watched sessions are released in order."""
        out: list[Item] = []
        for cursor, event in events:
            track = self._tracks.get(event.session_id)
            if track is None:
                continue
            if track.next is not None and event.seq == track.next and not track.held:
                out.append((cursor, event))  # the common case
                track.next += 1
            elif track.next is None or event.seq >= track.next:  # the next one, behind a gap too: it fills it
                track.held.setdefault(event.seq, (cursor, event))
                self._gap(event.session_id, track, out)
            # else: released already
        if out:
            self._deliver(out)

    def _gap(self, sid: str, track: _Track, out: list[Item]) -> None:
        if track.next is None:
            return  # released once the last durable seq is known
        out.extend(_release(track))
        if len(track.held) > HELD_MAX:
            logger.warning("session %s: %d events held behind a gap; closing its streams", sid, len(track.held))
            self.forget(sid)
            self._overflow(sid)
        elif track.held and track.task is None:
            track.task = asyncio.create_task(self._repair(sid, track), name=f"order-repair:{sid}")

    async def _start(self, sid: str, track: _Track) -> None:
        try:
            head = await self.store.last_seq(sid)
        except Exception as err:
            if self._tracks.get(sid) is track:
                del self._tracks[sid]
            track.ready.set_exception(err)
            track.ready.exception()  # retrieved here too: every waiter may have gone
            return
        track.next = head + 1
        track.task = None
        for seq in [s for s in track.held if s <= head]:
            del track.held[seq]  # in the replay of every subscriber (it starts after this read)
        track.ready.set_result(None)
        out: list[Item] = []
        self._gap(sid, track, out)
        if out:
            self._deliver(out)

    async def _repair(self, sid: str, track: _Track) -> None:
        delay = GAP_WAIT_S
        try:
            while track.held:
                await asyncio.sleep(delay)
                try:
                    out = await self._read(sid, track)
                except Exception as err:  # the database is unavailable: try again
                    logger.warning("session %s: cannot read events to fill a gap (%r); will retry", sid, err)
                    delay = min(delay * 2, RETRY_MAX_S)
                    continue
                delay = GAP_WAIT_S
                if out:
                    self._deliver(out)
        finally:
            track.task = None

    async def _read(self, sid: str, track: _Track) -> list[Item]:
        """Fill the gap below the held events from the database; what it lacks below them is a hole.

        The database decides, whatever messages said: every event a node published was durable first, so an event
        held since before the read that the read does not find is not durable (a message that lied), and the
        database's row of a ``seq`` replaces what a message said of it."""
        assert track.next is not None
        self.repairs += 1
        start = track.next
        before = set(track.held)
        page = await self.store.events(sid, since=start - 1, limit=PAGE)
        if track.next != start:  # released meanwhile (the missing events came): the read may be stale
            return _release(track)
        self._take(track, page)
        # the read covers every seq up to its last row; and every seq held before it, unless the page was full
        top = page[-1].seq if page else start - 1
        wrong = _unfound(track.held, {event.seq for event in page}, top, set() if len(page) == PAGE else before)
        for seq in wrong:
            del track.held[seq]
        if wrong:
            self.discarded += len(wrong)
            logger.warning("session %s: %d event(s) announced through Redis are not in the database", sid, len(wrong))
        return _release(track, through=top)

    def _take(self, track: _Track, page: list[Event]) -> None:
        """Hold the database's events in the place of what messages said of their seqs."""
        for event in page:
            mine = track.held.get(event.seq)
            if mine is None:
                self.repaired += 1
            elif not _same(mine[1], event):
                self.discarded += 1
            track.held[event.seq] = (event.cursor or 0, event)


def _unfound(held: dict[int, Item], found: set[int], top: int, before: set[int]) -> list[int]:
    """The held seqs a read that found ``found`` shows are not durable: those up to ``top``, and those of
    ``before``, that it did not find."""
    return [seq for seq in held if seq not in found and (seq <= top or seq in before)]


def _same(a: Event, b: Event) -> bool:
    return a.type == b.type and a.data == b.data


def _release(track: _Track, through: int = 0) -> list[Item]:
    """The held events that follow the last released one; with ``through``, every held one up to it (the seqs
    missing below it are holes)."""
    assert track.next is not None
    out: list[Item] = []
    held = track.held
    while held:
        item = held.pop(track.next, None)
        if item is not None:
            out.append(item)
            track.next += 1
        elif track.next <= through:
            track.next = min(min(held), through + 1)
        else:
            break
    return out
