"""The MCP server at ``/mcp``: Streamable HTTP (stateless, JSON answers), the caller's API key as its bearer.

An MCP client is a caller like any other: each tool call is made as its REST request, in process, through the
whole application (``httpx.ASGITransport``), with the caller's credential. So the route checks the scope and charges
the budget of its door, applies the ``Idempotency-Key``, writes the ``operator.action`` audit entry, and in cluster
mode the routing seam sends a command for another node's session to that node: nothing is decided twice, or
differently, for MCP. A REST answer that is not a success becomes a tool error naming its problem (a missing scope,
an exhausted budget with its ``Retry-After``, a session that is not active).

The endpoint itself refuses a request without a valid credential (401, as REST does) before the protocol is read.
The protocol (``protocol.py``, the official SDK) is imported and started by the first request that reaches it: the SDK
was a fifth of every server's start, the time a restarted node takes to serve again.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from ...runtime.aio import cancel_and_wait
from ..auth import ANONYMOUS, AuthError, authenticate, bearer
from ..deps import services
from ..problems import problem_response
from ..rate_limit import RateLimiter

if TYPE_CHECKING:
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

PATH = "/mcp"

logger = logging.getLogger("switchboard.api.mcp")


class McpService:
    """The MCP server of one application: the Streamable HTTP endpoint (this ASGI application), open while ``run()``
    is entered (the application's lifespan); the protocol behind it starts with the first request it serves."""

    def __init__(self, app: ASGIApp, *, max_text_chars: int) -> None:
        self.app = app  # where tool calls are sent, as REST requests
        self.max_text_chars = max_text_chars
        self._open = False
        self._manager: asyncio.Future[StreamableHTTPSessionManager] | None = None  # the SDK's, once started
        self._task: asyncio.Task[None] | None = None

    @asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        """Serve ``/mcp`` inside this block; leaving it stops the protocol, if a request started it."""
        self._open = True
        try:
            yield
        finally:
            self._open = False
            task, self._task, self._manager = self._task, None, None
            if task is not None:
                await cancel_and_wait(task)

    async def _started(self) -> StreamableHTTPSessionManager:
        """The SDK's manager, started by the first caller. It holds an anyio task group, which must be left by the
        task that entered it, so it runs in a task of its own; a caller that goes away meanwhile does not stop it."""
        if self._manager is None:
            if not self._open:  # pragma: no cover - the lifespan runs it before any request is served
                raise RuntimeError("the MCP server is not running")
            from .protocol import McpProtocol  # the SDK, on first use

            protocol = McpProtocol(self.app, max_text_chars=self.max_text_chars)
            ready: asyncio.Future[StreamableHTTPSessionManager] = asyncio.get_running_loop().create_future()

            async def serve() -> None:
                try:
                    async with protocol.serving(ready):
                        await asyncio.Event().wait()  # until cancelled: ``run()`` is left
                except Exception:
                    logger.exception("the MCP server stopped")  # its callers get a 500; the next one starts it again
                finally:
                    if self._manager is ready:  # it ended by itself: the next request starts it again
                        self._task = self._manager = None
                    if not ready.done():
                        ready.set_exception(RuntimeError("the MCP server did not start"))
                        ready.exception()  # retrieved: its waiters (if any are left) get it

            self._manager = ready
            self._task = asyncio.create_task(serve(), name="mcp-server")
        return await asyncio.shield(self._manager)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``/mcp``: 401 without a valid credential (with auth on), else the protocol."""
        request = Request(scope, receive)
        try:
            principal = authenticate(services(request).settings, bearer(None, request.headers.get("authorization")))
        except AuthError as err:
            headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
            await problem_response(err.status, err.code, err.detail, headers=headers)(scope, receive, send)
            return
        body = await request.body()  # small: the body limit applies; read once, given again to the protocol below
        if principal is not ANONYMOUS and _protocol_only(body):
            # a tool call spends its REST operation's budget; the protocol's own requests (initialize, tools/list,
            # ping) spend a read each, so that no key can send them without limit
            wait_s = await services(request).reads.acquire(principal.budget)
            if wait_s is not None:
                detail = "Too many reads from this credential; retry after Retry-After seconds."
                headers = {"Retry-After": RateLimiter.retry_after(wait_s)}
                await problem_response(429, "rate_limited", detail, headers=headers)(scope, receive, send)
                return
        manager = await self._started()
        await manager.handle_request(scope, _replay(body, receive), send)


__all__ = ["PATH", "McpService"]


def _protocol_only(body: bytes) -> bool:
    """Whether a JSON-RPC message (or batch) holds no ``tools/call``: what the protocol asks of the server itself.
    A body that is not JSON is the protocol's to refuse, and costs a read too."""
    try:
        message = json.loads(body)
    except ValueError:
        return True
    messages = message if isinstance(message, list) else [message]
    return not any(isinstance(m, dict) and m.get("method") == "tools/call" for m in messages)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` with ``body``, already read from it, given again first."""
    sent = False

    async def replayed() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # what comes after the body: the client going away

    return replayed
