"""The MCP server at ``/mcp``: Streamable HTTP (stateless, JSON answers), the caller's API key as its bearer.

An MCP client is a caller like any other: each tool call is made as its REST request, in process, through the
whole application (``httpx.ASGITransport``), with the caller's credential. So the route checks the scope and charges
the budget of its door, applies the ``Idempotency-Key``, writes the ``operator.action`` audit entry, and in cluster
mode the routing seam sends a command for another node's session to that node: nothing is decided twice, or
differently, for MCP. A REST answer that is not a success becomes a tool error naming its problem (a missing scope,
an exhausted budget with its ``Retry-After``, a session that is not active).

The endpoint itself refuses a request without a valid credential (401, as REST does) before the protocol is read.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from mcp.server import Server, ServerRequestContext
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.exceptions import MCPError
from mcp_types import (
    INVALID_PARAMS,
    CallToolRequestParams,
    CallToolResult,
    ListToolsResult,
    PaginatedRequestParams,
    TextContent,
    Tool,
)
from pydantic import ValidationError
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from ... import __version__
from ...runtime.aio import cancel_and_wait
from ..audit import IDEMPOTENCY_HEADER
from ..auth import ANONYMOUS, AuthError, authenticate, bearer
from ..deps import services
from ..problems import problem_response
from ..rate_limit import RateLimiter
from .tools import BY_NAME, TOOLS, McpTool, RestCall, input_schema

PATH = "/mcp"
INSTRUCTIONS = (
    "Switchboard hosts live agent sessions. List sessions (or those needing attention), read a session's transcript, "
    "inject user input, make the agent say something, interrupt it, and list or cancel its tool calls. Each tool is "
    "one REST operation of the server, with the same scopes and budgets."
)
PLAIN_DETAIL_MAX_CHARS = 500  # of an error answer that is not a problem document
# what the tool's REST request carries from the MCP request (the caller, the host it reached)
_PASSED_HEADERS = ("authorization", "host", "traceparent", "tracestate")


class McpService:
    """The MCP server of one application: its tools, and the Streamable HTTP endpoint (this ASGI application) that
    serves them while ``run()`` is entered (the application's lifespan)."""

    def __init__(self, app: ASGIApp, *, max_text_chars: int) -> None:
        self.app = app  # where tool calls are sent, as REST requests
        self.tools = [_tool(tool, max_text_chars) for tool in TOOLS]
        self.server: Server[Any] = Server(
            "switchboard",
            version=__version__,
            instructions=INSTRUCTIONS,
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
        )
        self._manager: StreamableHTTPSessionManager | None = None

    @asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        """Serve ``/mcp`` inside this block. The SDK's manager holds an anyio task group, which must be left by the
        task that entered it: it runs in a task of its own, so the block may be entered and left by any task."""
        manager = StreamableHTTPSessionManager(self.server, json_response=True, stateless=True)
        ready = asyncio.get_running_loop().create_future()

        async def serve() -> None:
            async with manager.run():
                self._manager = manager
                ready.set_result(None)
                try:
                    await asyncio.Event().wait()  # until cancelled: the block below is left
                finally:
                    self._manager = None

        task = asyncio.create_task(serve(), name="mcp-server")
        try:
            await asyncio.wait({ready, task}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                task.result()  # it failed to start: its error
            yield
        finally:
            await cancel_and_wait(task)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``/mcp``: 401 without a valid credential (with auth on), else the protocol."""
        request = Request(scope, receive)
        try:
            principal = authenticate(services(request).settings, bearer(None, request.headers.get("authorization")))
        except AuthError as err:
            headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
            await problem_response(err.status, err.code, err.detail, headers=headers)(scope, receive, send)
            return
        if self._manager is None:  # pragma: no cover - the lifespan runs it before any request is served
            raise RuntimeError("the MCP server is not started")
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
        await self._manager.handle_request(scope, _replay(body, receive), send)

    async def _list_tools(
        self, ctx: ServerRequestContext[Any], params: PaginatedRequestParams | None
    ) -> ListToolsResult:
        return ListToolsResult(tools=self.tools)

    async def _call_tool(self, ctx: ServerRequestContext[Any], params: CallToolRequestParams) -> CallToolResult:
        tool = BY_NAME.get(params.name)
        if tool is None:
            raise MCPError(INVALID_PARAMS, f"Unknown tool {params.name!r}; tools/list names them.")
        try:
            args = tool.args.model_validate(params.arguments or {})
        except ValidationError as err:
            return _error(f"Invalid arguments: {_first_error(err)}", None)
        request = ctx.request
        if not isinstance(request, Request):  # pragma: no cover - Streamable HTTP always gives the request
            raise MCPError(INVALID_PARAMS, "This server answers tool calls over HTTP only.")
        response = await self._rest(request, tool.request(args))
        return _result(tool, response)

    async def _rest(self, request: Request, call: RestCall) -> httpx.Response:
        """Make ``call`` as the REST request of the MCP request ``request``'s caller, through the application."""
        headers = {name: value for name in _PASSED_HEADERS if (value := request.headers.get(name)) is not None}
        if call.idempotency_key is not None:
            headers[IDEMPOTENCY_HEADER] = call.idempotency_key
        peer = (request.client.host, request.client.port) if request.client else ("127.0.0.1", 0)
        transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False, client=peer)
        async with httpx.AsyncClient(transport=transport, base_url="http://switchboard") as client:
            return await client.request(call.method, call.path, params=call.params, json=call.body, headers=headers)


def _tool(tool: McpTool, max_text_chars: int) -> Tool:
    return Tool(
        name=tool.name,
        title=tool.title,
        description=f"{tool.description} (REST: {tool.operation}; scope {tool.scope})",
        input_schema=input_schema(tool, max_text_chars),
        annotations=tool.annotations.model_copy(update={"title": tool.title}),
    )


def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "arguments"
    return f"{where}: {first['msg']}"


def _result(tool: McpTool, response: httpx.Response) -> CallToolResult:
    try:
        body: Any = response.json() if response.content else None
    except ValueError:  # not JSON: every answer of the API is, but a proxy's or a server's last-resort one may not be
        body = None
    if response.is_success:
        structured = body if isinstance(body, dict) else {"done": True}  # close_session: 204, no body
        return CallToolResult(content=[TextContent(text=json.dumps(structured))], structured_content=structured)
    if not isinstance(body, dict):
        body = {"status": response.status_code, "detail": response.text[:PLAIN_DETAIL_MAX_CHARS]}
    text = f"{tool.operation} answered {response.status_code} {body.get('code', '')}: {body.get('detail', '')}"
    retry_after = response.headers.get("retry-after")
    if retry_after is not None:
        text += f" Retry after {retry_after} s."
    return _error(text, body)


def _error(text: str, problem: dict[str, Any] | None) -> CallToolResult:
    return CallToolResult(content=[TextContent(text=text)], structured_content=problem, is_error=True)


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
