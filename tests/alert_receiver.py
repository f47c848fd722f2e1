"""A real alert sink for tests: a Starlette app served by uvicorn on a loopback port, in the test's loop.

It verifies every request as a receiver would, with the ``standardwebhooks`` library (a bad signature gets 401 and is
counted), answers with scripted statuses (``answers``: the next one per request, the last one repeating; default 204),
and records each verified message with its ``webhook-id``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import socket
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import uvicorn
from standardwebhooks.webhooks import Webhook, WebhookVerificationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.waiting import WAIT_S


def make_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


@dataclass(frozen=True)
class Message:
    webhook_id: str
    body: dict[str, Any]

    @property
    def type(self) -> str:
        return str(self.body["type"])

    @property
    def data(self) -> dict[str, Any]:
        return dict(self.body["data"])


class AlertReceiver:
    def __init__(self, secret: str | None = None) -> None:
        self.secret = secret or make_secret()
        self.answers: list[int] = [204]
        self.messages: list[Message] = []  # every verified attempt the receiver accepted (2xx)
        self.attempts: dict[str, int] = defaultdict(int)  # webhook-id -> verified attempts, whatever the answer
        self.bad_signatures = 0
        self.received: asyncio.Queue[Message] = asyncio.Queue()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = int(self._sock.getsockname()[1])
        app = Starlette(routes=[Route("/alerts", self._alert, methods=["POST"])])
        config = uvicorn.Config(app, log_level="warning", lifespan="off", http="h11", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/alerts"

    async def __aenter__(self) -> AlertReceiver:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]), name="alert-receiver")
        async with asyncio.timeout(WAIT_S):
            while not self._server.started:
                await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        self._sock.close()

    async def next(self, timeout_s: float = WAIT_S) -> Message:
        async with asyncio.timeout(timeout_s):
            return await self.received.get()

    async def _alert(self, request: Request) -> Response:
        body = await request.body()
        try:
            parsed = Webhook(self.secret).verify(body, dict(request.headers))
        except WebhookVerificationError:
            self.bad_signatures += 1
            return Response(status_code=401)
        webhook_id = request.headers["webhook-id"]
        self.attempts[webhook_id] += 1
        status = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if 200 <= status < 300:
            message = Message(webhook_id, dict(parsed if isinstance(parsed, dict) else json.loads(body)))
            self.messages.append(message)
            self.received.put_nowait(message)
        return Response(status_code=status)
