"""A real webhook backend for tests: a Starlette app served by uvicorn on a loopback port, in the test's loop.

It checks every request's signature (by default with ``switchboard.integrations.webhooks.verify_signature``; a bad one
gets 401 and is counted), records deliveries and cancel notices, and answers each tool with scripted responses.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from switchboard.integrations.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER
from switchboard.integrations.webhooks import verify_signature
from tests.waiting import WAIT_S

Answer = tuple[int, Any]  # (status, JSON body or None)
#: whether a request is signed: (raw body, headers) -> ok
Check = Callable[[bytes, Mapping[str, str]], bool]


class FakeBackend:
    def __init__(self, secret: str, check: Check | None = None) -> None:
        self.secret = secret
        self.check = check or self._switchboard_signed
        self.calls: list[dict[str, Any]] = []
        self.call_headers: list[dict[str, str]] = []  # the headers of each call in ``calls``
        self.attempt_headers: list[dict[str, str]] = []  # the headers of every signed delivery, whatever its answer
        self.cancels: list[dict[str, Any]] = []
        self.cancel_headers: list[dict[str, str]] = []  # the headers of each notice in ``cancels``
        self.bad_signatures = 0
        self.attempts: dict[str, int] = defaultdict(int)
        self.answers: dict[str, list[Answer]] = {}  # tool -> answers in order; the last one repeats
        self.received: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = int(self._sock.getsockname()[1])
        app = Starlette(
            routes=[
                Route("/tools/{name}", self._call, methods=["POST"]),
                Route("/tools/{name}/cancel", self._cancel, methods=["POST"]),
            ]
        )
        config = uvicorn.Config(app, log_level="warning", lifespan="off", http="h11", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def __aenter__(self) -> FakeBackend:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]), name="fake-backend")
        async with asyncio.timeout(WAIT_S):
            while not self._server.started:
                await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        self._sock.close()

    async def next(self, kind: str, timeout: float = WAIT_S) -> dict[str, Any]:
        """The next delivery (``"call"``) or cancel notice (``"cancel"``); fails on anything else first."""
        async with asyncio.timeout(timeout):
            got, payload = await self.received.get()
        assert got == kind, (got, payload)
        return payload

    def _switchboard_signed(self, body: bytes, headers: Mapping[str, str]) -> bool:
        return verify_signature(self.secret, headers.get(TIMESTAMP_HEADER), body, headers.get(SIGNATURE_HEADER))

    async def _verified(self, request: Request) -> dict[str, Any] | None:
        body = await request.body()
        if not self.check(body, request.headers):
            self.bad_signatures += 1
            return None
        return dict(json.loads(body))

    async def _call(self, request: Request) -> Response:
        payload = await self._verified(request)
        if payload is None:
            return JSONResponse({"detail": "bad signature"}, status_code=401)
        name = request.path_params["name"]
        self.attempts[name] += 1
        self.attempt_headers.append(dict(request.headers))
        script = self.answers.get(name) or [(200, {"output": f"{name} done"})]
        status, body = script.pop(0) if len(script) > 1 else script[0]
        if status < 300:
            self.calls.append(payload)
            self.call_headers.append(dict(request.headers))
            await self.received.put(("call", payload))
        if isinstance(body, bytes):  # sent as it is (JSON that JSONResponse could not write, e.g. "\ud800")
            return Response(body, status_code=status, media_type="application/json")
        return Response(status_code=status) if body is None else JSONResponse(body, status_code=status)

    async def _cancel(self, request: Request) -> Response:
        payload = await self._verified(request)
        if payload is None:
            return JSONResponse({"detail": "bad signature"}, status_code=401)
        self.cancels.append(payload)
        self.cancel_headers.append(dict(request.headers))
        await self.received.put(("cancel", payload))
        return Response(status_code=204)
