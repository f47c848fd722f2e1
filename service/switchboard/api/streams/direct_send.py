"""Sending a live event to a stream (a WebSocket, an SSE response) from within the hub's publish, as a broadcast does.

A stream's pump is a task: waking a thousand of them for each event, each to send one frame, costs more than the
sends themselves and spreads one event's delivery over the whole round. While a stream's pump waits idle for its
next event, ``DirectSend`` sends that event at once instead, in the publishing call: an ASGI send (a WebSocket
message, an HTTP body chunk) whose socket accepts more data completes without suspending. A send that does suspend
(the client's socket is full) is finished by a task, and the pump waits for that task before its own next send, so
frames stay in order. A WebSocket that offers ``send_shared`` (``ws_protocol``) writes the frames' bytes, encoded
once for every subscriber.

The pump's own events (the replay, and what was buffered while it was busy) go through ``DirectSend.send``, so every
frame of a stream passes one gate: the stream's position, the last ``seq`` its client got. An event at or below it is
not sent again, whichever way it came: the replay and the live events overlap (an event the replay read may reach the
hub after the stream went live), and in cluster mode an event can reach a node twice.

The events of one publish (a commit's events: a progress update, a turn's start) are written together, in one write
to the socket: a socket write costs about as much as everything else a subscriber's event costs, and a burst of events
to a thousand subscribers would otherwise pay it for every frame.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

from ...control.hub import Item, Subscription
from ...runtime.events import Event
from .ws_protocol import SendShared


class SendClock(Protocol):
    since: float | None


async def _drive(coro: Coroutine[Any, Any, None], yielded: Any) -> None:
    """Run to its end a coroutine started by hand (``coro.send(None)``) that suspended on ``yielded``."""
    try:
        while True:
            if isinstance(yielded, asyncio.Future):
                yielded._asyncio_future_blocking = False  # what a Task does with an awaited future
                await asyncio.wait({yielded})
            try:
                yielded = coro.send(None)
            except StopIteration:
                return
    except BaseException:
        coro.close()
        raise


class DirectSend:
    """``Subscription.direct`` for a stream (see the module docstring); ``send_text`` sends one frame."""

    def __init__(
        self,
        send_text: Callable[[str], Coroutine[Any, Any, None]],
        sub: Subscription,
        frames: Callable[[Event, str | None], Sequence[str]],
        resume: list[int],
        sends: SendClock,
        terminal: Sequence[str],
        *,
        shared: SendShared | None = None,
        joined: bool = False,
    ) -> None:
        self.send_text = send_text
        self.sub = sub
        self.frames = frames
        self.resume = resume
        self.sends = sends
        self.terminal = frozenset(terminal)
        self.pending: asyncio.Task[None] | None = None
        self.shared = shared  # writes frames at once, together, or says False: they go through ``send_text``
        self.joined = joined  # frames are parts of one byte stream (SSE): written together as one ``send_text``

    def __call__(self, items: Sequence[Item]) -> int:
        """Send the events of one publish, from the first up to a terminal one; how many were taken."""
        if self.pending is not None or self.sub.error is not None:
            return 0  # the pump sends them
        try:
            taken, frames, ends, last = self._collect(items)
        except Exception as err:  # a frame that cannot be made ends this stream (its pump raises), not the publish
            self.sub.fail(err)
            return len(items)
        if taken == 0:
            return 0
        if self.joined and len(frames) > 1:
            frames, ends = ["".join(frames)], [last]
        try:
            if not frames or (self.shared is not None and self.shared(*frames)):
                self.resume[0] = last
                return taken
            for i, frame in enumerate(frames):
                coro = self.send_text(frame)
                try:
                    yielded = coro.send(None)
                except StopIteration:
                    self._sent(ends[i])
                    continue
                self.sends.since = time.monotonic()
                rest = list(zip(frames[i + 1 :], ends[i + 1 :], strict=True))
                self.pending = asyncio.ensure_future(self._finish(coro, yielded, ends[i], rest))
                return taken
        except Exception as err:  # a failed send ends the stream, through its pump
            self.sub.fail(err)
            return taken
        self.resume[0] = last
        return taken

    def _collect(self, items: Sequence[Item]) -> tuple[int, list[str], list[int | None], int]:
        """The frames of ``items`` up to a terminal one, without the events the stream has sent already: how many
        items that takes, the frames, per frame the seq of the event it completes (None: more frames of it follow),
        and the stream's position once they are written."""
        frames: list[str] = []
        ends: list[int | None] = []
        taken, last = 0, self.resume[0]
        for _, event, text in items:
            if event.seq <= last:  # sent already: the replay read it before the hub got it, or it came twice
                taken += 1
                continue
            if event.type in self.terminal:
                break  # the pump sends it, and ends the stream
            made = self.frames(event, text)
            if made:
                frames += made
                if len(made) > 1:
                    ends += [None] * (len(made) - 1)
                ends.append(event.seq)
            elif ends:  # no frame of its own: delivered with the frame before it
                ends[-1] = event.seq
            else:  # no frame, and nothing before it waits: delivered now
                self.resume[0] = event.seq
            last = event.seq
            taken += 1
        return taken, frames, ends, last

    async def send(self, event: Event, text: str | None) -> None:
        """Send an event of the stream's pump (replayed, or buffered while the pump was busy), unless the stream has
        sent it already."""
        await self.settled()  # a direct send still finishing goes first
        if event.seq <= self.resume[0]:
            return
        for frame in self.frames(event, text):
            self.sends.since = time.monotonic()
            await self.send_text(frame)
            self.sends.since = None
        self.resume[0] = event.seq

    def _sent(self, seq: int | None) -> None:
        """A frame is written: the stream resumes after its event once the event's last frame is."""
        if seq is not None:
            self.resume[0] = seq

    async def _finish(
        self,
        coro: Coroutine[Any, Any, None],
        yielded: Any,
        first_end: int | None,
        rest: Sequence[tuple[str, int | None]],
    ) -> None:
        """Finish a send that suspended, then send the rest; the stream's position follows each event written, so a
        stream closed meanwhile (4008) names exactly what its client got."""
        try:
            await _drive(coro, yielded)
            self._sent(first_end)
            for frame, end in rest:
                await self.send_text(frame)
                self._sent(end)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            self.sub.fail(err)
        finally:
            self.sends.since = None
            self.pending = None

    async def settled(self) -> None:
        """Wait for a send that did not finish at once (before the pump's own next send)."""
        if self.pending is not None:
            await asyncio.wait({self.pending})

    async def aclose(self) -> None:
        self.sub.direct = None
        if self.pending is not None:
            self.pending.cancel()
            await asyncio.wait({self.pending})
