"""Request body limits as pure ASGI middleware: 413 for oversize bodies, 408 for bodies that trickle in.

A violation found while the app reads the body is answered here, at once, and the app is then told the client went
away (``http.disconnect``): an exception raised from ``receive`` would be turned into a 400 by the framework's body
parsing. Anything the app sends after that is dropped.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .problems import problem_response

_DISCONNECT: Message = {"type": "http.disconnect"}


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
        body_done = False
        started = False
        rejected = False
        replied = False

        async def reject(status: int, code: str) -> Message:
            nonlocal rejected, replied
            if not rejected and not started:
                await self._reply(scope, receive, send, status, code)
                replied = True
            rejected = True
            return _DISCONNECT

        async def limited_receive() -> Message:
            nonlocal seen, body_done
            if rejected:
                return _DISCONNECT
            if body_done:  # waiting for a disconnect may legitimately take long
                return await receive()
            try:
                async with asyncio.timeout(self.read_timeout_s):
                    message = await receive()
            except TimeoutError:
                return await reject(408, "body_timeout")
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    return await reject(413, "body_too_large")
                body_done = not message.get("more_body", False)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if replied:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, limited_receive, tracking_send)

    async def _reply(self, scope: Scope, receive: Receive, send: Send, status: int, code: str) -> None:
        detail: dict[int, str] = {
            413: f"The request body exceeds {self.max_bytes} bytes.",
            408: "The request body was not received in time.",
        }
        response: Any = problem_response(status, code, detail[status], headers={"Connection": "close"})
        await response(scope, receive, send)
