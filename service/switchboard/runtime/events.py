"""Events: the per-session, gap-free log of state changes (I6)."""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import itertools
import re
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime
from functools import lru_cache
from typing import Any, Protocol

from pydantic import BaseModel, Field

from .chat import utcnow
from .event_types import EVENT_TYPES, EventPayload, UnknownEventType


class Event(BaseModel):
    seq: int
    session_id: str
    type: str
    at: datetime = Field(default_factory=utcnow)
    data: dict[str, Any] = Field(default_factory=dict)
    #: Position in the store's global log, set once durable (not part of the wire format of a session stream).
    cursor: int | None = Field(default=None, exclude=True)


class EventSink(Protocol):
    """Where an ``EventLog`` publishes: one of the runtime's ports (see ``ports``)."""

    def publish(self, event: Event) -> Awaitable[None]:
        """Accept ``event`` now, in call order; the awaitable resolves once it is durable and delivered.

        Events of one session arrive with strictly increasing ``seq``; the sink must keep that order.
        """
        ...


def type_matcher(patterns: Iterable[str] | None) -> Callable[[str], bool]:
    """A predicate for event types from glob patterns such as ``tool.*`` (None or empty: everything)."""
    return _compiled_matcher(tuple(p.strip() for p in patterns or () if p.strip()))


@lru_cache(maxsize=256)
def _compiled_matcher(pats: tuple[str, ...]) -> Callable[[str], bool]:
    """Cached: clients that reconnect with the same filter must not pay (or make the event loop pay) for compiling
    it again; many globs take tens of milliseconds to compile."""
    if not pats:
        return lambda _type: True
    # one compiled pattern: this runs for every event and every subscriber
    regex = re.compile("|".join(fnmatch.translate(p) for p in pats))
    return lambda event_type: regex.match(event_type) is not None


class EventLog:
    """Assigns each session event the next ``seq`` and hands it to the sink, in order.

    ``emit`` is synchronous so that seq order equals call order even across tasks; it returns an awaitable that
    resolves once the sink has made the event durable and delivered it.
    """

    def __init__(self, session_id: str, sink: EventSink, *, last_seq: int = 0) -> None:
        self.session_id = session_id
        self._sink = sink
        self._seq = itertools.count(last_seq + 1)
        self.last_seq = last_seq
        self._last_durable: Awaitable[None] | None = None

    def emit(self, payload: EventPayload) -> Awaitable[None]:
        """Log ``payload`` as the session's next event; only a registered payload model is accepted."""
        if EVENT_TYPES.get(payload.type) is not type(payload):
            raise UnknownEventType(f"{type(payload).__name__} is not a registered event payload")
        event = Event(seq=next(self._seq), session_id=self.session_id, type=payload.type, data=payload.data())
        self.last_seq = event.seq
        self._last_durable = self._sink.publish(event)
        return self._last_durable

    async def flushed(self) -> None:
        """Return once every event emitted so far is durable (the sink makes them durable in order). An event the
        sink failed to write was logged there; it does not make this fail."""
        if self._last_durable is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._last_durable)


def done_future() -> asyncio.Future[None]:
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    fut.set_result(None)
    return fut
