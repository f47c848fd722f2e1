"""A media edge over a real WebSocket, for tests and benchmarks: it records what the server sends (``speech.*``,
``error``) and sends ``playback.*`` / ``user.*`` frames when told to (it plays nothing by itself)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlencode

import websockets
from websockets.asyncio.client import ClientConnection

from tests.waiting import WAIT_S

Frame = dict[str, Any]


class Edge:
    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.frames: list[Frame] = []
        self.received_at: list[float] = []  # time.perf_counter() of each frame's receipt
        self.texts: dict[str, str] = {}  # speech_id -> the text sent for its current segment
        self.closed: tuple[int, str] | None = None
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._read())

    @classmethod
    async def connect(
        cls, ws_url: str, sid: str, *, token: str | None = None, query: dict[str, Any] | None = None, **kw: Any
    ) -> Edge:
        params = {**({"token": token} if token else {}), **(query or {})}
        url = f"{ws_url}/v1/sessions/{sid}/media" + (f"?{urlencode(params)}" if params else "")
        return cls(await websockets.connect(url, **kw))

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                frame = json.loads(raw)
                self.received_at.append(time.perf_counter())
                self.frames.append(frame)
                if frame["type"] == "speech.start":
                    self.texts[frame["speech_id"]] = ""
                elif frame["type"] == "speech.text":
                    self.texts[frame["speech_id"]] = self.texts.get(frame["speech_id"], "") + frame["delta"]
                self._changed.set()
        except websockets.ConnectionClosed:
            pass
        finally:
            if self.ws.close_code is not None:
                self.closed = (self.ws.close_code, self.ws.close_reason or "")
            self._changed.set()

    async def send(self, frame: Frame | str | bytes) -> None:
        await self.ws.send(frame if isinstance(frame, str | bytes) else json.dumps(frame))

    def of_type(self, kind: str) -> list[Frame]:
        return [f for f in self.frames if f["type"] == kind]

    async def wait_for(self, kind: str, pred: Any = lambda f: True, timeout: float = WAIT_S) -> Frame:
        async with asyncio.timeout(timeout):
            while True:
                for frame in self.frames:
                    if frame["type"] == kind and pred(frame):
                        return frame
                if self._task.done():
                    raise AssertionError(f"edge closed ({self.closed}) before {kind}; got {self.frames}")
                self._changed.clear()
                await self._changed.wait()

    async def wait_text(self, speech_id: str, chars: int, timeout: float = WAIT_S) -> str:
        """The speech's text once at least ``chars`` characters of it were sent."""
        async with asyncio.timeout(timeout):
            while len(self.texts.get(speech_id, "")) < chars:
                if self._task.done():
                    raise AssertionError(f"edge closed ({self.closed}) before {chars} characters of {speech_id}")
                self._changed.clear()
                await self._changed.wait()
        return self.texts[speech_id]

    async def wait_closed(self, timeout: float = WAIT_S) -> tuple[int, str]:
        async with asyncio.timeout(timeout):
            await asyncio.shield(self._task)
        assert self.closed is not None
        return self.closed

    async def close(self) -> None:
        await self.ws.close()
        await self._task
