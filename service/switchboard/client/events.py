"""Event streams that resume: each event once, in order, across disconnects, slow-consumer closes and restarts.

A session stream resumes from the last ``seq`` it yielded (``since=``), the multi-session stream from the last
``cursor``. A close with 4008 ("too slow; resume with since=N") reconnects at once; a lost connection or a
restarting service is retried with backoff for ``reconnect_for_s``; a close that no retry can fix (unknown session,
bad credential) raises its typed error. A session stream ends when its session has closed.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncGenerator, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal
from urllib.parse import quote, urlencode

from pydantic import ValidationError
from websockets.asyncio.client import connect as aconnect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.sync.client import connect

from .errors import BadRequest, Forbidden, NotFound, SwitchboardError, Unauthorized, Unavailable, fatal_close
from .models import Event

CLOSE_SLOW_CONSUMER = 4008
SESSION_CLOSED = (1000, "session closed")
RECONNECT_FIRST_S = 0.1
RECONNECT_MAX_S = 2.0
# a connection that stayed up this long was healthy: a later failure starts a new reconnect window
STABLE_CONNECTION_S = 5.0
OPEN_TIMEOUT_S = 10.0
MAX_FRAME_BYTES = 2**23
_RESUME_REASON = re.compile(r"resume with (?:since|cursor)=(\d+)")
# an HTTP answer to the handshake that no retry changes (a wrong URL, a proxy refusing the credential)
_HANDSHAKE_ERRORS: dict[int, type[SwitchboardError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
}


@dataclass(frozen=True)
class Resume:
    """Why a stream is about to reconnect, and from where (passed to an ``on_resume`` hook)."""

    #: ``too_slow``: the service closed it with 4008; ``connection_lost``: it dropped (or could not be opened);
    #: ``gap``: a ``seq`` was missing, so it reads again from the last one yielded
    reason: Literal["too_slow", "connection_lost", "gap"]
    position: int | Literal["now"]  #: the seq (or cursor) it resumes after
    code: int  #: the close code (1006 without one; 0 for a gap)
    detail: str  #: the close reason, or the error
    delay_s: float  #: how long it waits before reconnecting


ResumeHook = Callable[[Resume], None]


class _Reconnect(Exception):
    """Leave this connection and resume from the position reached (a missing ``seq`` was noticed)."""


class _Position:
    """Where a stream stands, what its URL is, and what each frame and each close means."""

    def __init__(
        self,
        base_url: str,
        *,
        session_id: str | None,
        start: int | Literal["now"],
        types: Sequence[str] | None,
        session_ids: Sequence[str] | None,
        reconnect_for_s: float,
        on_resume: ResumeHook | None = None,
    ) -> None:
        self.on_resume = on_resume
        self.base_url = ("ws" + base_url[4:] if base_url.startswith("http") else base_url).rstrip("/")
        self.session_id = session_id
        self.last: int | Literal["now"] = start
        self.types = list(types) if types else None
        self.session_ids = list(session_ids) if session_ids else None
        self.reconnect_for_s = reconnect_for_s
        self.failing_since: float | None = None
        self.delay_s = RECONNECT_FIRST_S
        self.opened_at: float | None = None
        self.done = False

    def url(self) -> str:
        query: dict[str, Any] = {}
        if self.session_id is not None:
            path = f"/v1/sessions/{quote(self.session_id, safe='')}/events"
            query["since"] = self.last
        else:
            path = "/v1/events"
            query["cursor"] = self.last
            if self.session_ids:
                query["session_ids"] = ",".join(self.session_ids)
        if self.types:
            query["types"] = ",".join(self.types)
        return f"{self.base_url}{path}?{urlencode(query)}"

    def opened(self) -> None:
        self.opened_at = time.monotonic()

    def take(self, raw: str | bytes) -> Event | None:
        """The event this frame carries, or None for a frame to skip (a pong, an event already yielded)."""
        try:
            event = Event.model_validate_json(raw)
        except ValidationError:
            return None  # not an event: the service's answer to an application-level ping
        position = event.seq if self.session_id is not None else event.cursor
        if position is None:
            return None
        if self.last != "now":
            if position <= self.last:
                return None
            if self.session_id is not None and self.types is None and position > self.last + 1:
                self._resuming("gap", 0, f"seq {self.last + 1} is missing", 0.0)
                raise _Reconnect  # seqs have no gaps: read again from the last one yielded
        self.last = position
        self.failing_since, self.delay_s = None, RECONNECT_FIRST_S
        if (event.type in ("session.closed", "session.failed")) and self.session_id is not None:
            self.done = True
        return event

    def closed(self, code: int, reason: str) -> float | None:
        """After a close: None when the stream has ended; else the delay before reconnecting. Raises when the
        close is final (an unknown session, a bad credential) or reconnecting has failed for too long."""
        if (code, reason) == SESSION_CLOSED or self.done:
            return None
        error = fatal_close(code, reason, self.session_id)
        if error is not None:
            raise error
        now = time.monotonic()
        if code == CLOSE_SLOW_CONSUMER:
            match = _RESUME_REASON.search(reason)
            # the service names what it sent; what was received is never more, so resume from the smaller
            if match and self.last != "now":
                self.last = min(self.last, int(match.group(1)))
            self.failing_since = None
            self._resuming("too_slow", code, reason, 0.0)
            return 0.0
        if self.opened_at is not None and now - self.opened_at >= STABLE_CONNECTION_S:
            self.failing_since, self.delay_s = None, RECONNECT_FIRST_S
        self.opened_at = None
        self.failing_since = self.failing_since or now
        if now - self.failing_since > self.reconnect_for_s:
            raise Unavailable(
                0,
                "stream_lost",
                f"Could not reconnect to {self.url()} for {self.reconnect_for_s:g} s ({code} {reason})",
            )
        delay, self.delay_s = self.delay_s, min(self.delay_s * 2, RECONNECT_MAX_S)
        self._resuming("connection_lost", code, reason, delay)
        return delay

    def _resuming(
        self, reason: Literal["too_slow", "connection_lost", "gap"], code: int, detail: str, delay: float
    ) -> None:
        if self.on_resume is not None:
            self.on_resume(Resume(reason, self.last, code, detail, delay))

    def handshake_failed(self, err: Exception) -> float | None:
        """A connection that was not opened: final for an HTTP answer that says so, else retried like a drop."""
        if isinstance(err, InvalidStatus):
            status = err.response.status_code
            cls = _HANDSHAKE_ERRORS.get(status)
            if cls is not None:
                raise cls(status, "handshake_refused", f"The event stream refused the connection ({status})") from err
        return self.closed(1006, str(err) or type(err).__name__)


class AsyncEventStream:
    """``async for event in stream``; ``await stream.aclose()`` (or ``async with``) releases the connection.

    ``position`` is the last ``seq`` (or ``cursor``) yielded: where a new stream would resume.
    """

    def __init__(self, position: _Position, headers: Mapping[str, str]) -> None:
        self._pos = position
        self._headers = dict(headers)
        self._events = self._run()

    @property
    def position(self) -> int | Literal["now"]:
        return self._pos.last

    def __aiter__(self) -> AsyncEventStream:
        return self

    async def __anext__(self) -> Event:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        await self._events.aclose()

    async def __aenter__(self) -> AsyncEventStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def _run(self) -> AsyncGenerator[Event, None]:
        pos = self._pos
        while True:
            try:
                async with aconnect(
                    pos.url(), additional_headers=self._headers, open_timeout=OPEN_TIMEOUT_S, max_size=MAX_FRAME_BYTES
                ) as ws:
                    pos.opened()
                    try:
                        async for raw in ws:
                            event = pos.take(raw)
                            if event is not None:
                                yield event
                    except ConnectionClosed:
                        pass
                    except _Reconnect:
                        continue  # leaving the block closes this connection
                delay = pos.closed(ws.close_code or 1006, ws.close_reason or "")
            except (OSError, TimeoutError, InvalidHandshake) as err:
                delay = pos.handshake_failed(err)
            if delay is None:
                return
            await asyncio.sleep(delay)


class EventStream:
    """``for event in stream``; ``stream.close()`` (or ``with``) releases the connection. See AsyncEventStream."""

    def __init__(self, position: _Position, headers: Mapping[str, str]) -> None:
        self._pos = position
        self._headers = dict(headers)
        self._events = self._run()

    @property
    def position(self) -> int | Literal["now"]:
        return self._pos.last

    def __iter__(self) -> EventStream:
        return self

    def __next__(self) -> Event:
        return next(self._events)

    def close(self) -> None:
        self._events.close()

    def __enter__(self) -> EventStream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _run(self) -> Generator[Event, None, None]:
        pos = self._pos
        while True:
            try:
                with connect(
                    pos.url(), additional_headers=self._headers, open_timeout=OPEN_TIMEOUT_S, max_size=MAX_FRAME_BYTES
                ) as ws:
                    pos.opened()
                    try:
                        for raw in ws:
                            event = pos.take(raw)
                            if event is not None:
                                yield event
                    except ConnectionClosed:
                        pass
                    except _Reconnect:
                        continue
                delay = pos.closed(ws.close_code or 1006, ws.close_reason or "")
            except (OSError, TimeoutError, InvalidHandshake) as err:
                delay = pos.handshake_failed(err)
            if delay is None:
                return
            time.sleep(delay)


def stream_position(
    base_url: str,
    *,
    session_id: str | None = None,
    start: int | Literal["now"] = 0,
    types: Sequence[str] | None = None,
    session_ids: Sequence[str] | None = None,
    reconnect_for_s: float,
    on_resume: ResumeHook | None = None,
) -> _Position:
    return _Position(
        base_url,
        session_id=session_id,
        start=start,
        types=types,
        session_ids=session_ids,
        reconnect_for_s=reconnect_for_s,
        on_resume=on_resume,
    )
