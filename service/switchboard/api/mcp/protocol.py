"""The MCP protocol itself, served by the official SDK: its tools (``tools.py``) as the SDK's types, and the calls it
makes of them. Imported when ``/mcp`` first serves a request (``server.McpService``), not with the application: the SDK
is a large share of a server's start, and most deployments never use it."""

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
    ToolAnnotations,
)
from pydantic import ValidationError
from starlette.requests import Request
from starlette.types import ASGIApp

from ... import __version__
from ..audit import IDEMPOTENCY_HEADER
from .tools import BY_NAME, TOOLS, Hints, McpTool, RestCall, input_schema

INSTRUCTIONS = (
    "Switchboard hosts live agent sessions. List sessions (or those needing attention), read a session's transcript, "
    "inject user input, make the agent say something, interrupt it, and list or cancel its tool calls. Each tool is "
    "one REST operation of the server, with the same scopes and budgets."
)
PLAIN_DETAIL_MAX_CHARS = 500  # of an error answer that is not a problem document
# what the tool's REST request carries from the MCP request (the caller, the host it reached)
_PASSED_HEADERS = ("authorization", "host", "traceparent", "tracestate")


class McpProtocol:
    """The SDK's server of one application's tools, each call made as its REST request through ``app``."""

    def __init__(self, app: ASGIApp, *, max_text_chars: int) -> None:
        self.app = app
        self.tools = [_tool(tool, max_text_chars) for tool in TOOLS]
        self.server: Server[Any] = Server(
            "switchboard",
            version=__version__,
            instructions=INSTRUCTIONS,
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
        )

    @asynccontextmanager
    async def serving(self, ready: asyncio.Future[StreamableHTTPSessionManager]) -> AsyncIterator[None]:
        """Run the SDK's manager (stateless, JSON answers) inside this block, given to ``ready`` once it serves."""
        manager = StreamableHTTPSessionManager(self.server, json_response=True, stateless=True)
        async with manager.run():
            ready.set_result(manager)
            yield

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
        annotations=_annotations(tool.annotations, tool.title),
    )


def _annotations(hints: Hints, title: str) -> ToolAnnotations:
    return ToolAnnotations(
        title=title,
        read_only_hint=hints.read_only,
        destructive_hint=hints.destructive,
        idempotent_hint=hints.idempotent,
        open_world_hint=hints.open_world,
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


__all__ = ["McpProtocol"]
