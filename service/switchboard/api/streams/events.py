"""WebSocket event streams: one session's log (resumable by seq) and a multi-session stream (by cursor).

Each connection is two pumps in a task group — events out, client messages in — plus an overflow watch; whichever
ends first cancels the others. A session stream's replay and live events are joined in ``session_stream``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect, WebSocketState

from ...control.hub import SubscriberOverflow, Subscription
from ...runtime.aio import cancel_and_wait
from ...runtime.events import Event
from ...runtime.text import read_json
from .. import deps
from ..auth import AuthError, Principal, authenticate, bearer, check, url_token
from .agui import SHARED, AguiTranslator
from .direct_send import DirectSend
from .session_stream import REPLAY_PAGE, TERMINAL_EVENTS, open_session_log, pump_log
from .stream_slots import TooManyStreams
from .ws_protocol import SendText, shared_sender, text_sender

logger = logging.getLogger("switchboard.api.ws")
router = APIRouter(tags=["events"])

MAX_TYPE_GLOBS = 64  # each glob is one more term of the store's filter and of the compiled matcher
MAX_TYPE_GLOB_CHARS = 100
# all the globs together: compiling a filter takes event-loop time in proportion to its characters and wildcards
# (64 globs of 100 characters, half of them wildcards, took ~45 ms), and each new filter is compiled once
MAX_TYPE_CHARS = 1000
MAX_TYPE_WILDCARDS = 64
MAX_SESSION_IDS = 500  # one query parameter each
SEND_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 2.0
# a client that fell behind gets as long to read up to its 4008 (queued behind what was already sent) as any send
# gets: a client slow for a moment still learns where to resume; one that stopped reading loses only the close
SLOW_CLOSE_TIMEOUT_S = SEND_TIMEOUT_S
CLOSE_NORMAL = 1000
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_MESSAGE_TOO_BIG = 1009  # sent by the server itself (ws_max_message_bytes) before a handler sees the message
CLOSE_INTERNAL_ERROR = 1011
CLOSE_BAD_REQUEST = 4400
CLOSE_UNAUTHENTICATED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_NOT_FOUND = 4404
CLOSE_TOO_MANY_STREAMS = 4429
CLOSE_SLOW_CONSUMER = 4008
MAX_POSITION = 2**63 - 1  # since / cursor
FORMAT_SWITCHBOARD = "switchboard"
FORMAT_AGUI = "ag-ui"

#: Every close code of the event streams and what it means to a client (published in the AsyncAPI document).
CLOSE_CODES: dict[int, str] = {
    CLOSE_NORMAL: "The stream ended normally: a session stream after the session's terminal event (`session.closed`, "
    "`session.failed`); either stream when the client left.",
    CLOSE_UNSUPPORTED_DATA: "The client sent a binary message; only JSON text messages are accepted.",
    CLOSE_MESSAGE_TOO_BIG: "The client sent a message larger than the server accepts.",
    CLOSE_INTERNAL_ERROR: "The server failed, or the client did not answer its keepalive pings: reconnect and resume.",
    CLOSE_SLOW_CONSUMER: "Too slow: the client fell behind (its buffer overflowed or a send stalled). Nothing is lost: "
    "the reason names where to resume, `too slow; resume with since=N` (or `cursor=N` on the multi-session stream).",
    CLOSE_BAD_REQUEST: "Bad request: `since` or `cursor` is not a non-negative integer, `format` is not `switchboard` "
    "or `ag-ui` (or `ag-ui` with `types`), `types` has more than "
    f"{MAX_TYPE_GLOBS} globs, one longer than {MAX_TYPE_GLOB_CHARS} characters, more than {MAX_TYPE_CHARS} characters "
    f"or {MAX_TYPE_WILDCARDS} wildcards in all, `session_ids` names more than "
    f"{MAX_SESSION_IDS} sessions, or a client message is not JSON.",
    CLOSE_UNAUTHENTICATED: "No valid credential (an API key or session token, as `token` or a Bearer header).",
    CLOSE_FORBIDDEN: "The credential lacks the `events:read` scope, is a session token of another session, or is a "
    "session token on the multi-session stream.",
    CLOSE_NOT_FOUND: "No such session (session stream only).",
    CLOSE_TOO_MANY_STREAMS: "Too many open event streams, for this credential (a session token counts as the key "
    "that minted it; `SWITCHBOARD_WS_MAX_STREAMS_PER_CREDENTIAL`, default 100) or for the server "
    "(`SWITCHBOARD_WS_MAX_STREAMS`, default 1000, of which the last `SWITCHBOARD_WS_OPERATOR_RESERVE`, default a "
    "tenth, are kept for keys holding `sessions:control`); the reason says which. Close a stream, or retry later "
    "with a backoff.",
}


class _Closed(Exception):
    def __init__(self, code: int, reason: str) -> None:
        self.code = code
        self.reason = reason


def _types(raw: str | None) -> list[str] | None:
    if not raw:
        return None
    globs = [t.strip() for t in raw.split(",") if t.strip()]
    if len(globs) > MAX_TYPE_GLOBS:
        raise _Closed(CLOSE_BAD_REQUEST, f"types: at most {MAX_TYPE_GLOBS} globs")
    if any(len(glob) > MAX_TYPE_GLOB_CHARS for glob in globs):
        raise _Closed(CLOSE_BAD_REQUEST, f"types: a glob has at most {MAX_TYPE_GLOB_CHARS} characters")
    if sum(len(glob) for glob in globs) > MAX_TYPE_CHARS:
        raise _Closed(CLOSE_BAD_REQUEST, f"types: at most {MAX_TYPE_CHARS} characters in all")
    if sum(glob.count("*") + glob.count("?") for glob in globs) > MAX_TYPE_WILDCARDS:
        raise _Closed(CLOSE_BAD_REQUEST, f"types: at most {MAX_TYPE_WILDCARDS} wildcards (* and ?) in all")
    return globs or None


def _session_ids(raw: str | None) -> list[str] | None:
    if not raw:
        return None
    ids = [s for s in raw.split(",") if s]
    if len(ids) > MAX_SESSION_IDS:
        raise _Closed(CLOSE_BAD_REQUEST, f"session_ids: at most {MAX_SESSION_IDS}")
    return ids


def _format(raw: str | None, types: list[str] | None) -> str:
    fmt = raw or FORMAT_SWITCHBOARD
    if fmt not in (FORMAT_SWITCHBOARD, FORMAT_AGUI):
        raise _Closed(CLOSE_BAD_REQUEST, f"format must be {FORMAT_SWITCHBOARD} or {FORMAT_AGUI}")
    if fmt == FORMAT_AGUI and types is not None:  # runs and tool calls are built from the whole log
        raise _Closed(CLOSE_BAD_REQUEST, "types cannot be combined with format=ag-ui")
    return fmt


def _int_param(ws: WebSocket, name: str) -> int:
    raw = ws.query_params.get(name, "0")
    try:
        value = int(raw)
    except ValueError:
        raise _Closed(CLOSE_BAD_REQUEST, f"{name} must be an integer") from None
    if value < 0:
        raise _Closed(CLOSE_BAD_REQUEST, f"{name} must be >= 0")
    if value > MAX_POSITION:  # the store's columns are 64-bit: a bigger one would fail in the query (1011)
        raise _Closed(CLOSE_BAD_REQUEST, f"{name} must be <= {MAX_POSITION}")
    return value


def _admit(ws: WebSocket, principal: Principal) -> Callable[[], None]:
    """A stream slot for ``principal`` (its release), or a 4429 close."""
    try:
        return deps.services(ws).streams.acquire(principal.budget, operator=principal.operator)
    except TooManyStreams as err:
        raise _Closed(CLOSE_TOO_MANY_STREAMS, err.reason) from None


def _authorize(ws: WebSocket, session_id: str | None) -> Principal:
    settings = deps.services(ws).settings
    try:
        credential = url_token(ws.query_params.getlist("token")) or bearer(None, ws.headers.get("authorization"))
        principal = authenticate(settings, credential)
        check(principal, "events:read", session_id)
        if session_id is None and principal.session_id is not None:
            raise AuthError(403, "forbidden", "A session token cannot read the multi-session stream.")
        return principal
    except AuthError as err:
        raise _Closed(CLOSE_UNAUTHENTICATED if err.status == 401 else CLOSE_FORBIDDEN, err.code) from None


async def _close(ws: WebSocket, code: int, reason: str, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
    if ws.application_state == WebSocketState.CONNECTED and ws.client_state == WebSocketState.CONNECTED:
        # a client that never reads would hold the closing handshake (and this handler) until its ping timeout
        with contextlib.suppress(Exception):
            async with asyncio.timeout(timeout_s):
                await ws.close(code=code, reason=reason[:120])


class Sends:
    """When the stream's send in progress began (None between sends). A send stuck for ``SEND_TIMEOUT_S`` is found
    by the stream's watch: a timer per frame (~5 us) would be paid for every subscriber of every event."""

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since: float | None = None

    def stalled(self) -> bool:
        return self.since is not None and time.monotonic() - self.since > SEND_TIMEOUT_S


async def _send(send_text: SendText, text: str, sends: Sends | None = None) -> None:
    if sends is None:
        async with asyncio.timeout(SEND_TIMEOUT_S):
            await send_text(text)
        return
    sends.since = time.monotonic()
    await send_text(text)
    sends.since = None


async def _receive(ws: WebSocket) -> None:
    """Answer application-level pings; return when the client goes away."""
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return
        text = message.get("text")
        if text is None:
            raise _Closed(CLOSE_UNSUPPORTED_DATA, "binary frames are not supported")
        try:
            data = read_json(text)
        except ValueError:  # not JSON, or nested too deeply to read
            raise _Closed(CLOSE_BAD_REQUEST, "messages must be JSON") from None
        if isinstance(data, dict) and data.get("type") == "ping":
            await _send(ws.send_text, json.dumps({"type": "pong"}))


async def fell_behind(sub: Subscription, sends: Sends) -> None:
    """Return once a stream fell behind: its buffer overflowed, or a send has been stuck for ``SEND_TIMEOUT_S``."""
    while not sub.overflow_ev.is_set() and not sends.stalled():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SEND_TIMEOUT_S / 4):
                await sub.overflow_ev.wait()


class _FellBehind(Exception):
    """The stream fell behind: closed 4008 with where to resume, named once its pump has stopped sending."""


async def _watch_overflow(sub: Subscription, sends: Sends) -> None:
    """End a stream that fell behind (``fell_behind``)."""
    await fell_behind(sub, sends)
    raise _FellBehind


async def _run(
    ws: WebSocket,
    sub: Subscription,
    pump: Coroutine[Any, Any, None],
    resume: list[int],
    sends: Sends,
    key: str = "since",
) -> None:
    """Run the pumps; ``resume[0]`` is the position to resume from, named ``key`` in a 4008 close reason."""
    metrics = deps.services(ws).metrics
    metrics.ws_connections.inc()
    tasks = [
        asyncio.create_task(pump, name="ws-pump"),
        asyncio.create_task(_receive(ws), name="ws-receive"),
        asyncio.create_task(_watch_overflow(sub, sends), name="ws-overflow"),
    ]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(*tasks)
        metrics.ws_connections.dec()
        sub.close()
    errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
    # the pump (buffer overflowed, send stalled) and the overflow watch can end in the same loop iteration
    err = next((e for e in errors if isinstance(e, _Closed)), errors[0] if errors else None)
    if isinstance(err, _FellBehind | SubscriberOverflow | TimeoutError):
        # read only now: until the pump was stopped, a send under way could still deliver more
        err = _Closed(CLOSE_SLOW_CONSUMER, f"too slow; resume with {key}={resume[0]}")
    if isinstance(err, _Closed):
        if err.code == CLOSE_SLOW_CONSUMER:
            metrics.ws_dropped.inc()
            await _close(ws, err.code, err.reason, SLOW_CLOSE_TIMEOUT_S)
            return
        await _close(ws, err.code, err.reason)
        return
    if err is not None and not isinstance(err, WebSocketDisconnect | ConnectionError | TimeoutError | RuntimeError):
        logger.error("event stream failed", exc_info=err)
        await _close(ws, CLOSE_INTERNAL_ERROR, "internal error")
        return
    await _close(ws, CLOSE_NORMAL, "bye")  # a failed send is a disconnect, not a crash


@router.websocket("/v1/sessions/{sid}/events")
async def session_events(ws: WebSocket, sid: str) -> None:
    """Stream one session's events: replay those after `since`, then live ones. Filter with `types=tool.*,...`.
    `format=ag-ui` sends AG-UI events instead (docs/ag-ui.md)."""
    await ws.accept()
    try:
        principal = _authorize(ws, sid)
        since = _int_param(ws, "since")
        types = _types(ws.query_params.get("types"))
        fmt = _format(ws.query_params.get("format"), types)
        services = deps.services(ws)
        if await services.host.find(sid) is None:
            raise _Closed(CLOSE_NOT_FOUND, "session_not_found")
        release = _admit(ws, principal)
    except _Closed as closed:
        await _close(ws, closed.code, closed.reason)
        return
    try:
        await _session_stream(ws, sid, since, types, fmt)
    finally:
        release()


async def _session_stream(ws: WebSocket, sid: str, since: int, types: list[str] | None, fmt: str) -> None:
    resume = [since]
    services = deps.services(ws)
    sub, log = await open_session_log(
        services.host.hub,
        services.store,
        sid,
        since,
        types,
        maxsize=services.settings.ws_buffer,
        has_ended=lambda: _has_ended(services, sid),
    )
    sends = Sends()
    translator = AguiTranslator(sid) if fmt == FORMAT_AGUI else None

    def frames(event: Event, text: str | None) -> list[str]:
        if translator is not None:
            return SHARED.ws(translator, event)
        return [text or event.model_dump_json()]

    # live events go out from the hub's publish while the pump waits idle (no task wakes per event), on every node:
    # in cluster mode too, the hub hands each subscription its session's events in order, none missing
    send_text = text_sender(ws)
    direct = DirectSend(send_text, sub, frames, resume, sends, TERMINAL_EVENTS, shared=shared_sender(ws))
    sub.direct = direct

    async def pump() -> None:
        await pump_log(log, direct)
        raise _Closed(CLOSE_NORMAL, "session closed")

    await _run(ws, sub, pump(), resume, sends)


async def _has_ended(services: deps.Services, sid: str) -> bool:
    session = await services.host.find(sid)
    return session is not None and session.ended


@router.websocket("/v1/events")
async def all_events(ws: WebSocket) -> None:
    """Stream events of many sessions (all, or `session_ids=a,b`), resumable by the `cursor` each frame carries.
    `cursor=now` starts at the live tail, without replaying history (for dashboards that load a snapshot first)."""
    await ws.accept()
    try:
        principal = _authorize(ws, None)
        from_now = ws.query_params.get("cursor") == "now"
        cursor = 0 if from_now else _int_param(ws, "cursor")
        types = _types(ws.query_params.get("types"))
        session_ids = _session_ids(ws.query_params.get("session_ids"))
        release = _admit(ws, principal)
    except _Closed as closed:
        await _close(ws, closed.code, closed.reason)
        return
    try:
        await _multi_stream(ws, cursor if not from_now else None, types, session_ids)
    finally:
        release()


async def _multi_stream(
    ws: WebSocket, start: int | None, types: list[str] | None, session_ids: list[str] | None
) -> None:
    """``start`` None: from the live tail."""
    from_now = start is None
    cursor = start or 0
    services = deps.services(ws)
    store, settings = services.store, services.settings
    # every matching event in cursor order (in cluster mode too: ``control.cluster.feed``), so that resuming by the
    # last cursor received misses nothing
    sub = services.hub.subscribe(session_ids=session_ids, types=types, maxsize=settings.ws_buffer, ordered=True)
    resume = [cursor]
    sends = Sends()
    send_text = text_sender(ws)

    def frame(c: int, event: Event) -> str:
        return json.dumps({"cursor": c, **event.model_dump(mode="json")})

    async def pump() -> None:
        last = cursor
        while not from_now:
            page = await store.events_multi(session_ids=session_ids, since_id=last, limit=REPLAY_PAGE)
            for c, event in page:
                last = resume[0] = c
                if sub.matches(event.type):
                    await _send(send_text, frame(c, event), sends)
            if len(page) < REPLAY_PAGE:
                break
        while True:
            c, event, _ = await sub.get()
            if c <= last:
                continue
            await _send(send_text, frame(c, event), sends)
            last = resume[0] = c

    await _run(ws, sub, pump(), resume, sends, key="cursor")
