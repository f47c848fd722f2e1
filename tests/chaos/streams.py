"""The chaos load's WebSocket clients, all through the balancer: a session stream that resumes with ``since=`` after
any close, the multi-session stream that resumes with ``cursor=``, and a media edge that plays each speech at once,
says final transcripts with ids and connects again, numbered, after any close. Each records what it saw for the
checker."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import websockets

from .history import History, now

AUTH_HEADER = "Authorization"
RECONNECT_S = 0.3
OPEN_TIMEOUT_S = 15.0
RESEND_S = 0.5  # a transcript refused `command_failed` is sent again this much later (docs/media-edge.md)


class _Resuming:
    """One WebSocket client that connects again (to whatever node the balancer picks) until it is stopped."""

    def __init__(self, ws_url: str, key: str) -> None:
        self.ws_url = ws_url
        self.headers = {AUTH_HEADER: f"Bearer {key}"}
        self.connections = 0
        self.closes: list[list[Any]] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._ws: Any = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def _url(self) -> str:
        raise NotImplementedError

    async def _on_frame(self, ws: Any, frame: dict[str, Any]) -> None:
        raise NotImplementedError

    async def _on_open(self, ws: Any) -> None:
        """What a client sends first on each new connection (nothing, unless it owes the server something)."""

    async def _run(self) -> None:
        while not self._stop.is_set():
            try:
                async with websockets.connect(
                    self._url(), additional_headers=self.headers, open_timeout=OPEN_TIMEOUT_S, ping_timeout=60
                ) as ws:
                    self._ws = ws
                    self.connections += 1
                    try:
                        await self._on_open(ws)
                        async for raw in ws:
                            await self._on_frame(ws, json.loads(raw))
                    finally:
                        self._ws = None
                        if not self._stop.is_set():  # the harness's own close at the end is not the server's
                            self.closes.append([now(), ws.close_code, ws.close_reason or ""])
            except (OSError, websockets.WebSocketException, TimeoutError) as err:
                if isinstance(err, websockets.InvalidStatus):
                    self.closes.append([now(), err.response.status_code, "handshake"])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), RECONNECT_S)

    async def aclose(self) -> None:
        self._stop.set()
        if self._ws is not None:
            with contextlib.suppress(Exception):
                await self._ws.close()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 20)  # bound: then the reader is cancelled
            except TimeoutError:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task


class SessionStream(_Resuming):
    """``WS /v1/sessions/{sid}/events?since=<last seq seen>``."""

    def __init__(self, ws_url: str, key: str, sid: str) -> None:
        super().__init__(ws_url, key)
        self.sid = sid
        self.frames: list[list[Any]] = []  # [seq, type, received at, connection number]
        self.last_seq = 0

    def _url(self) -> str:
        return f"{self.ws_url}/v1/sessions/{self.sid}/events?since={self.last_seq}"

    async def _on_frame(self, ws: Any, frame: dict[str, Any]) -> None:
        self.frames.append([frame["seq"], frame["type"], now(), self.connections])
        self.last_seq = int(frame["seq"])

    def record(self, history: History) -> None:
        history.add("stream", sid=self.sid, frames=self.frames, connections=self.connections, closes=self.closes)


class MultiStream(_Resuming):
    """``WS /v1/events?cursor=<last cursor seen>``: every session's events."""

    def __init__(self, ws_url: str, key: str) -> None:
        super().__init__(ws_url, key)
        self.frames: list[list[Any]] = []  # [cursor, sid, seq, type]
        self.cursor = 0

    def _url(self) -> str:
        return f"{self.ws_url}/v1/events?cursor={self.cursor}"

    async def _on_frame(self, ws: Any, frame: dict[str, Any]) -> None:
        self.frames.append([frame["cursor"], frame["session_id"], frame["seq"], frame["type"]])
        self.cursor = int(frame["cursor"])

    def record(self, history: History) -> None:
        history.add("multi", frames=self.frames, connections=self.connections, closes=self.closes)


@dataclass
class Transcript:
    """A final transcript the edge said, kept until a `transcript.taken` names it; the fields are what the history
    records of it."""

    id: str
    text: str
    said_at: float
    taken_at: float | None = None
    item_id: str | None = None
    sends: int = 0
    acks: int = 0
    errors: list[str] = field(default_factory=list)


class MediaEdge(_Resuming):
    """``WS /v1/sessions/{sid}/media?edge_id=...&connection=N``: plays every speech at once (started, then finished
    at its end) and connects again after any close, as an edge told 4410 does. Each attempt gets the next number, so
    an attempt it gave up on that reaches the session later is refused (4409) instead of replacing the live
    connection. Final transcripts are sent with an id and kept until taken: on every new connection, those not taken
    go first, in order."""

    def __init__(self, ws_url: str, key: str, sid: str) -> None:
        super().__init__(ws_url, key)
        self.sid = sid
        self.edge_id = secrets.token_urlsafe(16)
        self.attempts = 0
        self.barge_ins: list[float] = []
        self.speeches = 0
        self.transcripts: dict[str, Transcript] = {}  # by id, in the order said
        self._pending: dict[str, Transcript] = {}  # said, not taken yet, in the order said
        self._sent_on: dict[str, int] = {}  # id -> the connection it was last sent on
        self._send_lock = asyncio.Lock()  # a connection's backlog goes out before anything said meanwhile
        self._resends: set[asyncio.Task[None]] = set()

    def _url(self) -> str:
        """The URL of the next connection attempt: each call is an attempt, numbered from 1."""
        self.attempts += 1
        return f"{self.ws_url}/v1/sessions/{self.sid}/media?edge_id={self.edge_id}&connection={self.attempts}"

    async def _on_open(self, ws: Any) -> None:
        async with self._send_lock:
            for transcript in list(self._pending.values()):
                await self._send(ws, transcript)

    async def _on_frame(self, ws: Any, frame: dict[str, Any]) -> None:
        kind = frame.get("type")
        with contextlib.suppress(websockets.ConnectionClosed):
            if kind == "speech.start":
                self.speeches += 1
                await ws.send(json.dumps({"type": "playback.started", "speech_id": frame["speech_id"]}))
            elif kind == "speech.end":
                await ws.send(json.dumps({"type": "playback.finished", "speech_id": frame["speech_id"]}))
            elif kind == "transcript.taken":
                self._taken(frame["id"], frame["item_id"])
            elif kind == "error" and frame.get("id") in self._pending:
                self._refused(ws, self._pending[frame["id"]], frame["code"], frame.get("retry_after_s"))

    def _taken(self, transcript_id: str, item_id: str) -> None:
        transcript = self.transcripts.get(transcript_id)
        if transcript is None:
            return
        transcript.acks += 1
        if transcript.taken_at is None:
            transcript.taken_at, transcript.item_id = now(), item_id
        self._pending.pop(transcript_id, None)

    def _refused(self, ws: Any, transcript: Transcript, code: str, retry_after_s: float | None = None) -> None:
        """`command_failed`: not taken, send it again in a moment (on this connection, or first on the next);
        `rate_limited`: the same, after the wait the service named."""
        transcript.errors.append(code)
        self._sent_on.pop(transcript.id, None)
        if code in ("command_failed", "rate_limited"):
            wait_s = retry_after_s if code == "rate_limited" and retry_after_s is not None else RESEND_S
            task = asyncio.create_task(self._resend(ws, transcript, wait_s))
            self._resends.add(task)
            task.add_done_callback(self._resends.discard)

    async def _resend(self, ws: Any, transcript: Transcript, wait_s: float) -> None:
        await asyncio.sleep(wait_s)
        async with self._send_lock:
            if ws is self._ws and transcript.id in self._pending:
                with contextlib.suppress(websockets.ConnectionClosed):
                    await self._send(ws, transcript)

    async def _send(self, ws: Any, transcript: Transcript) -> None:
        """Send it on this connection unless it already went there (said while the backlog was going out)."""
        if self._sent_on.get(transcript.id) == self.connections:
            return
        self._sent_on[transcript.id] = self.connections
        transcript.sends += 1
        frame = {"type": "user.transcript", "text": transcript.text, "final": True, "id": transcript.id}
        await ws.send(json.dumps(frame))

    async def say(self, text: str) -> Transcript:
        """The user said ``text`` (a final transcript): sent now if connected, else first on the next connection."""
        transcript = Transcript(id=str(uuid.uuid4()), text=text, said_at=now())
        self.transcripts[transcript.id] = self._pending[transcript.id] = transcript
        async with self._send_lock:
            ws = self._ws
            if ws is not None:
                with contextlib.suppress(websockets.ConnectionClosed):
                    await self._send(ws, transcript)
        return transcript

    @property
    def pending(self) -> int:
        """Transcripts said and not taken yet."""
        return len(self._pending)

    async def barge_in(self) -> bool:
        """The user starts talking; False when no connection is open to say it on."""
        ws = self._ws
        if ws is None:
            return False
        try:
            await ws.send(json.dumps({"type": "user.speech_started"}))
        except websockets.ConnectionClosed:
            return False
        self.barge_ins.append(now())
        return True

    async def aclose(self) -> None:
        for task in list(self._resends):
            task.cancel()
        await asyncio.gather(*self._resends, return_exceptions=True)
        await super().aclose()

    def record(self, history: History) -> None:
        history.add(
            "edge",
            sid=self.sid,
            edge_id=self.edge_id,
            closes=self.closes,
            barge_ins=self.barge_ins,
            connections=self.connections,
            attempts=self.attempts,
            speeches=self.speeches,
            transcripts=[asdict(t) for t in self.transcripts.values()],
        )
