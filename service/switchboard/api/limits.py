"""Request limits as pure ASGI middleware.

``BodyLimit``: 413 for oversize bodies, 408 for bodies that trickle in (each chunk must arrive within
``read_timeout_s``, the whole body within ``body_timeout_s``). A violation found while the app reads the body is
answered here, at once, and the app is then told the client went away (``http.disconnect``): an exception raised from
``receive`` would be turned into a 400 by the framework's body parsing. Anything the app sends after that is dropped.

``RequestDeadline``: 503 with ``Retry-After`` when handling a request takes longer than ``timeout_s`` (time spent
waiting for the request body is not counted: ``BodyLimit`` bounds that). A safe request (GET, HEAD, OPTIONS) is
cancelled; any other is left to finish in the background (it may have side effects half done, and an
``Idempotency-Key`` retry must find its outcome), its late response dropped.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .problems import problem_response

logger = logging.getLogger("switchboard.api")

_DISCONNECT: Message = {"type": "http.disconnect"}
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
RETRY_AFTER_S = 1
BODY_POLL_S = 0.1


class BodyLimit:
    def __init__(
        self, app: ASGIApp, *, max_bytes: int, read_timeout_s: float = 10.0, body_timeout_s: float = 30.0
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = None
        for key, value in scope.get("headers") or ():  # the last one, as a dict of them would hold
            if key == b"content-length":
                length = value
        if length is not None:
            try:
                too_big = int(length) > self.max_bytes
            except ValueError:
                too_big = False
            if too_big:
                await self._reply(scope, receive, send, 413, "body_too_large")
                return
        seen = 0
        # the whole body, not just each chunk, is bounded: a slow trickle cannot hold a request open indefinitely
        body_deadline = asyncio.get_running_loop().time() + self.body_timeout_s
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
            loop = asyncio.get_running_loop()
            try:
                async with asyncio.timeout_at(min(loop.time() + self.read_timeout_s, body_deadline)):
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


class RequestDeadline:
    """A backstop deadline on every HTTP request (see the module docstring)."""

    def __init__(self, app: ASGIApp, *, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s
        self._background: set[asyncio.Task[None]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        reading = 0
        started = late = False

        async def timed_receive() -> Message:
            nonlocal deadline, reading
            reading += 1
            t0 = loop.time()
            try:
                return await receive()
            finally:
                reading -= 1
                deadline += loop.time() - t0  # waiting for the client is not handling time

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if late:
                return  # the client already has its 503
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        async def handle() -> None:
            await self.app(scope, timed_receive, guarded_send)

        task = asyncio.create_task(handle(), name="http-request")
        try:
            while not task.done():
                if started:  # too late for a 503: the response is on its way
                    await asyncio.wait({task})
                    break
                # while the body is still arriving the deadline moves: look again shortly
                wait_s = BODY_POLL_S if reading else deadline - loop.time()
                if wait_s <= 0:
                    break
                await asyncio.wait({task}, timeout=wait_s)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task.done():
            task.result()  # its exception, if any, goes up as if there were no deadline
            return
        late = True
        method = scope.get("method", "")
        logger.warning("%s %s: no response within %.1fs; answered 503", method, scope.get("path"), self.timeout_s)
        if method in SAFE_METHODS:
            task.cancel()
            await asyncio.wait({task})
        else:
            self._background.add(task)
            task.add_done_callback(self._finished)
        response = problem_response(
            503,
            "deadline_exceeded",
            f"The request could not be completed within {self.timeout_s:g} s; retry"
            + ("." if method in SAFE_METHODS else " (with the same Idempotency-Key: it may still take effect)."),
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
        await response(scope, receive, send)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("a request answered 503 failed later", exc_info=task.exception())
