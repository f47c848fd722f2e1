"""Request body limits as pure ASGI middleware: 413 for oversize bodies, 408 for bodies that trickle in."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .problems import problem_response


class _TooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app: ASGIApp, *, max_bytes: int, read_timeout_s: float = 10.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_bytes
            except ValueError:
                too_big = False
            if too_big:
                await self._reply(scope, receive, send, 413, "body_too_large")
                return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            try:
                async with asyncio.timeout(self.read_timeout_s):
                    message = await receive()
            except TimeoutError:
                raise _SlowBody from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._reply(scope, receive, send, 413, "body_too_large")
        except _SlowBody:
            if not started:
                await self._reply(scope, receive, send, 408, "body_timeout")

    async def _reply(self, scope: Scope, receive: Receive, send: Send, status: int, code: str) -> None:
        detail: dict[int, str] = {
            413: f"The request body exceeds {self.max_bytes} bytes.",
            408: "The request body was not received in time.",
        }
        response: Any = problem_response(status, code, detail[status], headers={"Connection": "close"})
        await response(scope, receive, send)


class _SlowBody(Exception):
    pass
