"""The media edge: ``WS /v1/sessions/{sid}/media`` (docs/media-edge.md).

One edge per session: it plays the session's speeches and reports their playback, and sends the user's barge-ins and
transcripts. The protocol lives in ``runtime/media.py``; this is its transport. Three pumps per connection — frames
in, frames out, and a watch (session gone, edge replaced, outbox overflowed) — whichever ends first ends the others.
In cluster mode an edge that reaches a node that does not run its session is relayed to the one that does
(``cluster.relay``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from dataclasses import dataclass, field

from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect

from ...control.cluster.routing import Elsewhere, Unavailable, locate
from ...runtime.aio import cancel_and_wait
from ...runtime.media import REPLAY_FRAMES, EdgeConnection, EdgePlayout, MediaEdge, StaleConnection
from ...runtime.media_frames import (
    ErrorFrame,
    FrameRefused,
    ResumedFrame,
    ResumeRefusedFrame,
    SpeechStopFrame,
    TranscriptTakenFrame,
    UserSpeechStartedFrame,
    UserTranscriptFrame,
    _Frame,
    parse_edge_frame,
)
from ...runtime.receipt import Receipt
from ...runtime.session import AgentSession, InputResult
from ...runtime.status import SessionClosed, SessionStatus, SessionSuspended
from ...runtime.text import read_json
from .. import audit, deps
from ..auth import ANONYMOUS, AuthError, Principal, authenticate, bearer, check, url_token
from ..idempotency import Attempt, KeyedCommands
from ..problems import ProblemError
from ..streams.events import _close
from .budget import rate_limited
from .codes import (
    CLOSE_BAD_REQUEST,
    CLOSE_FORBIDDEN,
    CLOSE_INTERNAL_ERROR,
    CLOSE_MESSAGE_TOO_BIG,
    CLOSE_NORMAL,
    CLOSE_NOT_ACTIVE,
    CLOSE_NOT_FOUND,
    CLOSE_REPLACED,
    CLOSE_SLOW_CONSUMER,
    CLOSE_TOO_MANY_FRAMES,
    CLOSE_UNAUTHENTICATED,
    CLOSE_UNSUPPORTED_DATA,
    MOVING,
    OUTBOX_FRAMES,
    RESUME_HOLD_S,
    SEND_TIMEOUT_S,
    TRANSCRIPT_NOT_TAKEN,
)

logger = logging.getLogger("switchboard.api.media")
router = APIRouter(tags=["media"])

SCOPE = "media:connect"
WATCH_INTERVAL_S = 0.25  # how often a connection checks that its session still runs here
FRAME_OVERHEAD_CHARS = 1024  # a transcript frame's JSON around its text
ESCAPED_CHARS = 6  # a character JSON-escaped as \uXXXX (what most encoders do with non-ASCII text by default)
EDGE_ID = re.compile(r"[A-Za-z0-9._~-]{1,64}")
CONNECTION_NUMBER = re.compile(r"[1-9][0-9]{0,15}")  # from 1, below 10**16
FRAME_NUMBER = re.compile(r"0|[1-9][0-9]{0,15}")


def max_frame_chars(max_text_chars: int) -> int:
    """The longest frame taken: a transcript of ``max_text_chars`` characters, each escaped, in its frame. The text's
    own limit is checked once decoded (an error frame, ``text_too_long``); this one only bounds what is read."""
    return ESCAPED_CHARS * max_text_chars + FRAME_OVERHEAD_CHARS


STOP_PREFIX = SpeechStopFrame(speech_id="").to_json().partition(",")[0]  # how a speech.stop frame begins


class _Closed(Exception):
    def __init__(self, code: int, reason: str) -> None:
        self.code = code
        self.reason = reason


@dataclass
class _Bucket:
    """Frames an edge may send: ``rate_per_s`` refilled, ``burst`` at most."""

    rate_per_s: float
    burst: float
    tokens: float = 0.0
    at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = self.burst

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate_per_s)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


def _keyed_transcripts(ws: WebSocket) -> KeyedCommands:
    """The service's final transcripts keyed by their id (one table per app: its locks are only a first gate, the
    reservation in the database decides, across nodes too)."""
    state = ws.app.state
    found: KeyedCommands | None = getattr(state, "media_transcripts", None)
    if found is None:
        found = state.media_transcripts = KeyedCommands()
    return found


def _authorize(ws: WebSocket, sid: str) -> Principal:
    settings = deps.services(ws).settings
    try:
        credential = url_token(ws.query_params.getlist("token")) or bearer(None, ws.headers.get("authorization"))
        principal = authenticate(settings, credential)
        check(principal, SCOPE, sid)
        return principal
    except AuthError as err:
        raise _Closed(CLOSE_UNAUTHENTICATED if err.status == 401 else CLOSE_FORBIDDEN, err.code) from None


def _connection(ws: WebSocket) -> EdgeConnection | None:
    """The edge's id and the number of this connection among its own (``edge_id``, ``connection``; both or neither):
    a connection older than one already taken from the same edge is refused rather than replacing it."""
    edge_id, number = ws.query_params.getlist("edge_id"), ws.query_params.getlist("connection")
    if not edge_id and not number:
        return None
    if len(edge_id) != 1 or len(number) != 1:
        raise _Closed(CLOSE_BAD_REQUEST, "edge_id and connection: one of each, or neither")
    if not EDGE_ID.fullmatch(edge_id[0]):
        raise _Closed(CLOSE_BAD_REQUEST, "edge_id: 1 to 64 characters of A-Z a-z 0-9 . _ ~ -")
    if not CONNECTION_NUMBER.fullmatch(number[0]):
        raise _Closed(CLOSE_BAD_REQUEST, "connection: a whole number from 1")
    return EdgeConnection(edge_id[0], int(number[0]))


def _resume(ws: WebSocket, connection: EdgeConnection | None) -> int | None:
    """The last frame (``n``) the edge consumed on its earlier connections (``resume``; 0: none yet), given by an edge
    that numbers its connections: it is sent what it missed, and held for its next connection if this one drops."""
    values = ws.query_params.getlist("resume")
    if not values:
        return None
    if connection is None:
        raise _Closed(CLOSE_BAD_REQUEST, "resume: only with edge_id and connection")
    if len(values) != 1 or not FRAME_NUMBER.fullmatch(values[0]):
        raise _Closed(CLOSE_BAD_REQUEST, "resume: one whole number from 0")
    return int(values[0])


async def _live_session(ws: WebSocket, sid: str) -> AgentSession:
    """The session, live here and active; else why not, as a close. In cluster mode an edge for a session another node
    runs was relayed there by the routing seam before this route ran (``cluster.routing.OwnerRouting``): one that
    reaches it anyway was relayed here by a node that saw this one as the owner, and is told to connect again."""
    services = deps.services(ws)
    host = services.host
    view = await host.find(sid)
    if view is None:
        raise _Closed(CLOSE_NOT_FOUND, "session_not_found")
    live = host.live(sid)
    if live is not None and live.state == SessionStatus.ACTIVE:
        return live
    if SessionStatus(view.state).ended:  # for good: nothing to connect again to (4410 would have the edge retry)
        raise _Closed(CLOSE_NORMAL, f"session {view.state}")
    where = await locate(host, sid, view.record)
    if isinstance(where, Elsewhere):
        services.metrics.on_media_relay("loop")
        raise _Closed(CLOSE_NOT_ACTIVE, f"session moved to node {where.node_id}; connect again")
    if isinstance(where, Unavailable):
        raise _Closed(CLOSE_NOT_ACTIVE, f"{where.retry.value}: connect again in a moment")
    state = live.state if live is not None else view.state
    raise _Closed(CLOSE_NOT_ACTIVE, f"session {state} here; connect again")


@router.websocket("/v1/sessions/{sid}/media")
async def media_edge(ws: WebSocket, sid: str) -> None:
    """Connect as the session's media edge: speeches are sent here to be played (`speech.*`), and the edge reports
    playback (`playback.*`) and the user (`user.*`). A second edge replaces the first (closed with 4409). Needs the
    `media:connect` scope (docs/media-edge.md). In cluster mode any node takes it: it is relayed to the session's
    node (``cluster.routing.OwnerRouting``)."""
    await ws.accept()
    services = deps.services(ws)
    try:
        principal = _authorize(ws, sid)
        connection = _connection(ws)
        resume = _resume(ws, connection)
        session = await _live_session(ws, sid)
    except _Closed as closed:
        await _close(ws, closed.code, closed.reason)
        return
    playout = session.playout
    if not isinstance(playout, EdgePlayout):  # pragma: no cover - every hosted session plays through one
        await _close(ws, CLOSE_INTERNAL_ERROR, "this session cannot take a media edge")
        return
    await _EdgeConnection(ws, session, playout, services, principal, resume).run(connection)


class _EdgeConnection:
    def __init__(
        self,
        ws: WebSocket,
        session: AgentSession,
        playout: EdgePlayout,
        services: deps.Services,
        principal: Principal,
        resume: int | None,
    ) -> None:
        settings = services.settings
        self.ws = ws
        # a transcript's id is the caller's, as an Idempotency-Key is (a session token's caller is its session)
        self.transcript_scope = f"{principal.identity} TRANSCRIPT /v1/sessions/{session.id}/media"
        self.principal = principal
        self.budget = services.transcripts
        self.session = session
        self.playout = playout
        self.outbox: asyncio.Queue[str] = asyncio.Queue(maxsize=OUTBOX_FRAMES)
        self.max_frame_chars = max_frame_chars(settings.max_text_chars)
        self.bucket = _Bucket(settings.media_max_frames_per_s, 2 * settings.media_max_frames_per_s)
        self.wake_ev = asyncio.Event()  # the watch looks at once: overflow, or this edge was replaced
        self.resume = resume  # the last frame the edge consumed, when it resumes
        self.edge = MediaEdge(
            session,
            self._enqueue,
            max_text_chars=settings.max_text_chars,
            on_close=self.wake_ev.set,
            replay_frames=REPLAY_FRAMES if resume is not None else 0,
        )
        self.sending_since: float | None = None
        self.overflowed = False
        self.barge_in_at: float | None = None
        self.metrics = services.metrics

    def _enqueue(self, frame: _Frame) -> None:
        try:
            self.outbox.put_nowait(frame.to_json())
        except asyncio.QueueFull:
            self.overflowed = True
            self.wake_ev.set()

    async def run(self, connection: EdgeConnection | None) -> None:
        log = {"session_id": self.session.id}
        try:
            previous = self._connect(connection, self.resume)
        except StaleConnection:
            assert connection is not None
            logger.info(
                "session %s: refused connection %d of edge %s, older than one already taken",
                self.session.id,
                connection.number,
                connection.edge_id,
                extra=log,
            )
            await _close(self.ws, CLOSE_REPLACED, "this edge connected again since")
            return
        if previous is not None:
            previous.close()  # its connection sees it and closes with 4409
        logger.info("session %s: a media edge connected", self.session.id, extra=log)
        self.metrics.media_edges.inc()
        tasks = [
            asyncio.create_task(self._receive(), name=f"media-receive:{self.session.id}"),
            asyncio.create_task(self._send(), name=f"media-send:{self.session.id}"),
            asyncio.create_task(self._watch(), name=f"media-watch:{self.session.id}"),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:  # one that ended just as this connection was cancelled: nobody else reads its end
                if task.done() and not task.cancelled():
                    task.exception()
            await cancel_and_wait(*tasks)
            if self.edge.sends_to(self._enqueue):  # not resumed on a newer connection
                held = self.resume is not None and self._runs_here() and self.playout.hold(self.edge, RESUME_HOLD_S)
                if not held:
                    self.playout.detach(self.edge)
                    self.edge.close()  # a speech it was playing ends interrupted where it was last reported
            self.metrics.media_edges.dec()
        logger.info("session %s: the media edge left", self.session.id, extra=log)
        await self._close(done)

    def _connect(self, connection: EdgeConnection | None, resume: int | None) -> MediaEdge | None:
        """Resume the edge's stream when it asks to and can (``resumed``, then what it missed), else play through a new
        one (``resume.refused`` first when it asked): returns the edge replaced, to be closed."""
        if connection is None or resume is None:
            return self.playout.attach(self.edge, connection)
        resumed = self.playout.resume(connection, resume, self._enqueue, self.wake_ev.set)
        if resumed is not None:
            self.edge = resumed
            return None
        if resume == 0:
            self._enqueue(ResumedFrame(after=0))  # nothing consumed, nothing missed
        else:
            detail = "the frames after it are not kept here (another node, or too long ago): start fresh"
            self._enqueue(ResumeRefusedFrame(after=resume, detail=detail))
        return self.playout.attach(self.edge, connection)

    def _runs_here(self) -> bool:
        state = self.session.state
        return state == SessionStatus.ACTIVE and deps.services(self.ws).host.live(self.session.id) is self.session

    async def _close(self, done: set[asyncio.Task[None]]) -> None:
        errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
        err = next((e for e in errors if isinstance(e, _Closed)), errors[0] if errors else None)
        if isinstance(err, _Closed):
            await _close(self.ws, err.code, err.reason)
        elif err is not None and not isinstance(err, WebSocketDisconnect | ConnectionError | RuntimeError):
            logger.error("media edge failed", exc_info=err, extra={"session_id": self.session.id})
            await _close(self.ws, CLOSE_INTERNAL_ERROR, "internal error")
        else:
            await _close(self.ws, CLOSE_NORMAL, "bye")

    async def _receive(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            if text is None:
                raise _Closed(CLOSE_UNSUPPORTED_DATA, "binary frames are not supported")
            if len(text) > self.max_frame_chars:
                raise _Closed(CLOSE_MESSAGE_TOO_BIG, f"a frame has at most {self.max_frame_chars} characters")
            if not self.bucket.take():
                raise _Closed(CLOSE_TOO_MANY_FRAMES, "too many frames per second")
            await self._apply(text)

    async def _apply(self, text: str) -> None:
        frame: object = None
        try:
            try:
                data = read_json(text)
            except ValueError:  # not JSON, or nested too deeply to read
                raise FrameRefused("bad_json", "a frame is a JSON text message") from None
            frame = parse_edge_frame(data)
            if isinstance(frame, UserSpeechStartedFrame) and self.edge.stops_current():
                self.barge_in_at = time.perf_counter()  # until its speech.stop is written (a metric)
            if isinstance(frame, UserTranscriptFrame):
                await self._transcript(frame)
            else:
                await self.edge.handle(frame)
        except FrameRefused as refused:
            self.edge.send(refused.error_frame())
        except SessionSuspended:  # moving to another node: the edge connects again, to any node, and goes on there
            # a final transcript the session could no longer take (its hand-over is sealed): the edge sends it again
            # once connected again, where the session runs next (docs/media-edge.md, 4410)
            lost = isinstance(frame, UserTranscriptFrame) and frame.final
            raise _Closed(CLOSE_NOT_ACTIVE, TRANSCRIPT_NOT_TAKEN if lost else MOVING) from None
        except SessionClosed:
            raise _Closed(CLOSE_NORMAL, "session ended") from None
        except Exception:  # a store failure, say: the edge is told, the connection and the session go on
            logger.exception("session %s: a media frame failed", self.session.id, extra={"session_id": self.session.id})
            failed = frame if isinstance(frame, UserTranscriptFrame) else None
            self.edge.send(
                ErrorFrame(
                    code="command_failed",
                    detail="the server could not apply this frame",
                    frame_type=failed.type if failed is not None else None,
                    id=failed.id if failed is not None else None,
                )
            )

    async def _transcript(self, frame: UserTranscriptFrame) -> None:
        """A transcript, once within its caller's budget (``media.budget``: an interim one over it is coalesced away,
        a final one refused with when to send it again); a final one is logged in the audit trail once taken."""
        self.edge.check_text(frame)  # a transcript refused anyway costs nothing
        if frame.final and frame.id is not None:
            await self._take(frame, frame.id)  # charged only when applied: a copy already taken is answered again
            return
        if not await self._within_budget(frame):
            return  # coalesced: the next interim transcript, or the final one, supersedes it
        if not frame.final:
            await self.edge.transcript(frame)
        else:
            self._audit(await self.edge.transcript(frame), None)

    async def _within_budget(self, frame: UserTranscriptFrame) -> bool:
        """Charge ``frame`` to its caller: True when within budget; an interim one over it is dropped (False), a final
        one refused (``rate_limited``, raised). With auth off there is one caller, the operator: nothing is limited."""
        if self.principal is ANONYMOUS:
            return True
        wait_s = await self.budget.charge(self.principal.budget, frame)
        if wait_s is None:
            return True
        self.metrics.media_transcripts_limited.labels("final" if frame.final else "interim").inc()
        if frame.final:
            raise rate_limited(frame, wait_s)
        return False

    def _audit(self, result: InputResult, transcript_id: str | None) -> None:
        audit.record_as(
            self.principal.name,
            self.session,
            "transcript",
            transcript_id,
            item_id=result.item_id,
            speech_id=result.speech_id,
        )

    async def _take(self, frame: UserTranscriptFrame, transcript_id: str) -> None:
        """A final transcript with an id: taken at most once for the session, on whatever node or connection it comes
        (its id reserved as an Idempotency-Key, completed by the input's own commit), and answered
        ``transcript.taken`` once durable; sent again after that answer was lost, it is answered again, not applied."""

        async def take(attempt: Attempt) -> dict[str, str | None]:
            await self._within_budget(frame)  # over it: refused, and the id's reservation is let go
            receipt: Receipt[InputResult] | None = attempt.receipt(lambda result: {"item_id": result.item_id})
            result = await self.edge.transcript(frame, receipt)
            self._audit(result, transcript_id)  # here: a copy answered again is not logged again
            return {"item_id": result.item_id}

        try:
            answer = await _keyed_transcripts(self.ws).run(
                self.ws, transcript_id, self.transcript_scope, {"text": frame.text}, take
            )
        except ProblemError as problem:
            if problem.status == 503:  # another connection's copy is still being applied: its answer comes here next
                raise _Closed(CLOSE_NOT_ACTIVE, TRANSCRIPT_NOT_TAKEN) from None
            raise FrameRefused(
                "transcript_id_reused", problem.detail or problem.code, frame.type, transcript_id
            ) from None
        self.edge.send(TranscriptTakenFrame(id=transcript_id, item_id=answer["item_id"]))

    async def _send(self) -> None:
        while True:
            text = await self.outbox.get()
            self.sending_since = time.monotonic()
            await self.ws.send_text(text)
            self.sending_since = None
            if self.barge_in_at is not None and text.startswith(STOP_PREFIX):
                self.metrics.media_barge_in.observe(time.perf_counter() - self.barge_in_at)
                self.barge_in_at = None

    async def _watch(self) -> None:
        while True:
            if self.overflowed or self._stalled():
                raise _Closed(CLOSE_SLOW_CONSUMER, "too slow: frames waited too long")
            if self.edge.gone:
                raise _Closed(CLOSE_REPLACED, "replaced by another edge")
            if not self.edge.sends_to(self._enqueue):
                raise _Closed(CLOSE_REPLACED, "this edge resumed on a newer connection")
            state = self.session.state
            if state.ended or state == SessionStatus.CLOSING:
                raise _Closed(CLOSE_NORMAL, f"session {state}")
            if state != SessionStatus.ACTIVE or deps.services(self.ws).host.live(self.session.id) is not self.session:
                # suspended by a shutdown, or moved to another node: where it runs next, the edge connects again
                raise _Closed(CLOSE_NOT_ACTIVE, f"session {state} here; connect again")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(WATCH_INTERVAL_S):
                    await self.wake_ev.wait()

    def _stalled(self) -> bool:
        return self.sending_since is not None and time.monotonic() - self.sending_since > SEND_TIMEOUT_S
