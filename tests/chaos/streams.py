"""The chaos load's WebSocket clients, all through the balancer: a session stream that resumes with ``since=`` after
any close, the multi-session stream that resumes with ``cursor=``, and a media edge that plays each speech at once
and connects again after any close. Each records what it saw for the checker."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import websockets

from .history import History, now

AUTH_HEADER = "Authorization"
RECONNECT_S = 0.3
OPEN_TIMEOUT_S = 15.0


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

    async def _run(self) -> None:
        while not self._stop.is_set():
            try:
                async with websockets.connect(
                    self._url(), additional_headers=self.headers, open_timeout=OPEN_TIMEOUT_S, ping_timeout=60
                ) as ws:
                    self._ws = ws
                    self.connections += 1
                    try:
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
                await asyncio.wait_for(self._task, 20)
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


class MediaEdge(_Resuming):
    """``WS /v1/sessions/{sid}/media``: plays every speech at once (started, then finished at its end) and connects
    again after any close, as an edge told 4410 does."""

    def __init__(self, ws_url: str, key: str, sid: str) -> None:
        super().__init__(ws_url, key)
        self.sid = sid
        self.barge_ins: list[float] = []
        self.speeches = 0

    def _url(self) -> str:
        return f"{self.ws_url}/v1/sessions/{self.sid}/media"

    async def _on_frame(self, ws: Any, frame: dict[str, Any]) -> None:
        kind = frame.get("type")
        with contextlib.suppress(websockets.ConnectionClosed):
            if kind == "speech.start":
                self.speeches += 1
                await ws.send(json.dumps({"type": "playback.started", "speech_id": frame["speech_id"]}))
            elif kind == "speech.end":
                await ws.send(json.dumps({"type": "playback.finished", "speech_id": frame["speech_id"]}))

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

    def record(self, history: History) -> None:
        history.add(
            "edge",
            sid=self.sid,
            closes=self.closes,
            barge_ins=self.barge_ins,
            connections=self.connections,
            speeches=self.speeches,
        )
