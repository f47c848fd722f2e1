"""MCP tools: the tools of a Model Context Protocol server, as tools of an agent.

An agent lists MCP servers (``Agent(..., mcp_servers=[...])``, or ``mcp_servers:`` in the agents file); each
server's tools become the agent's tools, with the same policies as Python tools (``on_duplicate``,
``allow_cancellation``, ``on_restart``) and a timeout. The executor cannot tell them apart from Python tools.

- Discovery: ``tools/list`` when a session of the agent starts (or recovers, or is handed to it), cached per server
  object for ``tools_ttl_s`` (at least ``MIN_TOOLS_TTL_S``); callers at the same moment share one listing, bounded
  as a whole by ``list_timeout_s``. A server that cannot be listed leaves its last list (or none) and is asked again
  after ``RELIST_AFTER_FAILURE_S``, so a server that is down never holds up every session start.
- Schemas: a tool whose input schema refers outside itself (a ``$ref`` that is not ``#...``) or to something it
  does not have is left out; nothing a schema names is ever fetched.
- Calls: each call opens its own MCP session (streamable HTTP, or a subprocess over stdio), calls the tool and closes
  it: nothing is held between calls, so a session that closes, a cancelled call and a timed-out one leave no
  connection, task or process behind.
- Progress notifications become ``ctx.update()``: ``PROGRESS_BURST`` at once, then one per ``PROGRESS_INTERVAL_S``, at
  most ``MAX_PROGRESS_UPDATES`` per call; the others are dropped. A call that is cancelled or times out sends
  ``notifications/cancelled`` to the server; a server that is down, hangs, answers too much or returns ``isError``
  gives the model an ``is_error`` output, never a hang.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import httpx2
import jsonschema
import referencing
import referencing.exceptions
import referencing.jsonschema
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from .. import __version__
from ..runtime.companions import COMPANION_TOOLS
from ..runtime.tools import CONFIRM_FIELD, FunctionTool, RunContext, ToolCancelled, ToolError, ToolPolicy

if TYPE_CHECKING:  # the SDK is imported when an MCP server is first spoken to, not with the agents file
    import mcp_types
    from mcp.client.session import ClientSession

logger = logging.getLogger("switchboard.integrations.mcp")

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_TOOLS_TTL_S = 300.0
MIN_TOOLS_TTL_S = 1.0
RELIST_AFTER_FAILURE_S = 30.0
#: A listing (connecting, the requests, closing) takes at most this long by default: a session's create waits for
#: it, and it stays below the request deadline (``request_timeout_s``, 10 s by default).
LIST_TIMEOUT_S = 5.0
#: The progress of one call that reaches the chat: a burst, then one update per interval, at most so many in all.
PROGRESS_BURST = 5
PROGRESS_INTERVAL_S = 0.25
MAX_PROGRESS_UPDATES = 20
#: How long an exchange may take past its requests' timeout: to connect, and to close (a subprocess to stop).
CLOSE_GRACE_S = 5.0
CONNECT_TIMEOUT_S = 10.0
#: The most of the bytes an HTTP server sends during one call (or one listing) that are read: more fails it.
MAX_ANSWER_BYTES = 4 * 1024 * 1024
DETAIL_MAX_CHARS = 300
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what model providers accept as a function name
#: What a schema's ``$ref`` may resolve against: the schema itself, nothing else (no retrieval: nothing is fetched).
NO_REMOTE_REFS: referencing.Registry[Any] = referencing.Registry()
REF_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")


class MCPToolPolicy(ToolPolicy):
    """A ``ToolPolicy`` plus the tool's own ``timeout_s`` (None: the server's). ``on_restart="resume"`` is not
    possible: an MCP call cannot be picked up again once its connection is gone."""

    timeout_s: float | None = Field(default=None, gt=0)

    @field_validator("on_restart")
    @classmethod
    def _not_resume(cls, value: str) -> str:
        if value == "resume":
            raise ValueError("an MCP tool cannot resume a call ('fail' or 'retry')")
        return value


# -- reading at most so much --------------------------------------------------------------------------------------


class _ByteBudget:
    """What an HTTP server may send during one exchange; going over cancels the exchange (``on_exceed``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.read = 0
        self.exceeded = False
        self.on_exceed: Callable[[], None] | None = None

    def take(self, n: int) -> bool:
        self.read += n
        if self.read > self.limit and not self.exceeded:
            self.exceeded = True
            if self.on_exceed is not None:
                self.on_exceed()
        return not self.exceeded


class _CappedStream(httpx2.AsyncByteStream):
    def __init__(self, inner: httpx2.AsyncByteStream, budget: _ByteBudget) -> None:
        self._inner = inner
        self._budget = budget

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            if not self._budget.take(len(chunk)):
                return  # the exchange is being cancelled: read nothing more
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class _CappedTransport(httpx2.AsyncBaseTransport):
    def __init__(self, budget: _ByteBudget) -> None:
        self._inner = httpx2.AsyncHTTPTransport()
        self._budget = budget

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        response.stream = _CappedStream(response.stream, self._budget)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


# -- servers ------------------------------------------------------------------------------------------------------


class MCPServer:
    """One MCP server an agent takes tools from. Build it once (a module-level object, or the agents file) and
    list it in each agent that uses it: its tool list is cached on the object.

    ``tools``: an allow-list of the server's tool names (None: all of them); ``policies``: per tool name, a
    ``MCPToolPolicy`` (or its fields as a dict); ``prefix``: put before each tool's name as the model sees it;
    ``list_timeout_s``: the most a listing of its tools takes, all told.
    """

    def __init__(
        self,
        *,
        name: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        tools: Iterable[str] | None = None,
        policies: Mapping[str, MCPToolPolicy | Mapping[str, Any]] | None = None,
        prefix: str = "",
        tools_ttl_s: float = DEFAULT_TOOLS_TTL_S,
        list_timeout_s: float = LIST_TIMEOUT_S,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
    ) -> None:
        if timeout_s <= 0 or list_timeout_s <= 0:
            raise ValueError("timeout_s and list_timeout_s must be positive")
        if tools_ttl_s < MIN_TOOLS_TTL_S:
            raise ValueError(f"tools_ttl_s must be at least {MIN_TOOLS_TTL_S:g} s")
        self.name = name
        self.timeout_s = timeout_s
        self.allowed = frozenset(tools) if tools is not None else None
        self.policies = {
            tool: p if isinstance(p, MCPToolPolicy) else MCPToolPolicy.model_validate(p)
            for tool, p in (policies or {}).items()
        }
        self.prefix = prefix
        self.tools_ttl_s = tools_ttl_s
        self.list_timeout_s = list_timeout_s
        self.max_answer_bytes = max_answer_bytes
        self._tools: list[MCPTool] = []
        self._listed_at: float | None = None
        self._failed_at: float | None = None
        self._listing: asyncio.Task[None] | None = None

    def connect(self, budget: _ByteBudget, timeout_s: float) -> AbstractAsyncContextManager[Any]:
        """The transport's (read, write) streams for one exchange."""
        raise NotImplementedError

    # -- discovery

    def tools(self) -> Sequence[FunctionTool]:
        """The tools as last listed (empty until the first listing succeeded)."""
        return self._tools

    def _fresh(self, now: float) -> bool:
        if self._listed_at is not None and now - self._listed_at < self.tools_ttl_s:
            return True
        return self._failed_at is not None and now - self._failed_at < RELIST_AFTER_FAILURE_S

    async def refresh(self) -> None:
        """List the server's tools unless the list is fresh. Callers at the same moment wait for one listing (a
        task of its own: a caller cancelled leaves it running for the others); a failure is logged and keeps the
        last list."""
        if self._fresh(time.monotonic()):
            return
        listing = self._listing
        if listing is None or listing.done() or listing.get_loop() is not asyncio.get_running_loop():
            listing = self._listing = asyncio.create_task(self._relist(), name=f"mcp-list:{self.name}")
        await asyncio.shield(listing)

    async def _relist(self) -> None:
        try:
            listed = await self._list()
        except asyncio.CancelledError:
            self._failed_at = time.monotonic()  # not listed: the next caller waits as after a failure
            raise
        except Exception as err:
            self._failed_at = time.monotonic()
            logger.warning("the tools of MCP server %s could not be listed: %s", self.name, _describe(err))
            return
        self._tools = self._build_tools(listed)
        self._listed_at, self._failed_at = time.monotonic(), None

    async def _list(self) -> list[mcp_types.Tool]:
        import mcp_types

        async def list_all(session: ClientSession) -> list[mcp_types.Tool]:
            found: list[mcp_types.Tool] = []
            cursor: str | None = None
            while True:
                params = mcp_types.PaginatedRequestParams(cursor=cursor) if cursor else None
                page = await session.list_tools(params=params)
                found.extend(page.tools)
                cursor = page.next_cursor
                if not cursor:
                    return found

        timeout_s = min(self.timeout_s, self.list_timeout_s)
        what = "its tools could not be listed"
        listed: list[mcp_types.Tool] = await self.exchange(list_all, timeout_s, what=what, total_s=self.list_timeout_s)
        return listed

    def _build_tools(self, listed: Sequence[mcp_types.Tool]) -> list[MCPTool]:
        built: list[MCPTool] = []
        names = {t.name for t in listed}
        for missing in sorted((self.allowed or frozenset()) - names):
            logger.warning("MCP server %s has no tool %r (named in its allow-list)", self.name, missing)
        for tool in listed:
            if self.allowed is not None and tool.name not in self.allowed:
                continue
            try:
                built.append(MCPTool(self, tool))
            except (ValueError, jsonschema.SchemaError) as err:
                logger.warning("tool %r of MCP server %s is left out: %s", tool.name, self.name, err)
        return built

    # -- one exchange

    async def exchange(
        self, work: Callable[[ClientSession], Any], timeout_s: float, *, what: str, total_s: float | None = None
    ) -> Any:
        """Open an MCP session, run ``work`` on it, close it. Each request waits at most ``timeout_s`` (a request
        that times out is cancelled at the server, ``notifications/cancelled``), the whole exchange at most
        ``total_s`` (by default ``CLOSE_GRACE_S`` more), and at most ``max_answer_bytes`` are read. A failure raises
        ``ToolError`` (``what`` says what failed); ``ToolCancelled`` from ``work`` goes through."""
        import mcp_types
        from mcp.client.session import ClientSession
        from mcp.shared.exceptions import MCPError

        budget = _ByteBudget(self.max_answer_bytes)
        total_s = timeout_s + CLOSE_GRACE_S if total_s is None else total_s
        with anyio.CancelScope(deadline=anyio.current_time() + total_s) as scope:
            budget.on_exceed = scope.cancel
            try:
                async with (
                    self.connect(budget, timeout_s) as (read, write),
                    ClientSession(read, write, read_timeout_seconds=timeout_s) as session,
                ):
                    await session.initialize()
                    return await work(session)
            except Exception as group:
                err = _first_leaf(group)
                if isinstance(err, ToolError | ToolCancelled):
                    raise err from None
                timed_out = isinstance(err, MCPError) and err.code == mcp_types.REQUEST_TIMEOUT
                if timed_out or isinstance(err, httpx2.TimeoutException):
                    raise ToolError(f"{self._whose()}: no answer within {timeout_s:g} s.") from None
                if not scope.cancel_called:
                    raise ToolError(f"{self._whose()}: {what} ({_describe(err)}).") from None
        if budget.exceeded:
            raise ToolError(f"{self._whose()}: it answered more than {self.max_answer_bytes} bytes.")
        raise ToolError(f"{self._whose()}: no answer within {timeout_s:g} s.")

    def _whose(self) -> str:
        return f"MCP server {self.name}"


class MCPServerHTTP(MCPServer):
    """A server reached over streamable HTTP at ``url``, with ``headers`` on every request (credentials: read them
    from the environment or a secret store, never write them in code)."""

    def __init__(self, url: str, *, headers: Mapping[str, str] | None = None, name: str | None = None, **kw: Any):
        super().__init__(name=name or _without_secrets(url), **kw)
        self.url = url
        self.headers = dict(headers or {})

    def __repr__(self) -> str:
        return f"<MCPServerHTTP {_without_secrets(self.url)}>"

    @asynccontextmanager
    async def connect(self, budget: _ByteBudget, timeout_s: float) -> AsyncIterator[Any]:
        from mcp.client.streamable_http import streamable_http_client

        client = httpx2.AsyncClient(
            headers={"user-agent": f"switchboard/{__version__}", **self.headers},
            # the request's own timeout (which cancels it at the server) comes first; these bound the rest
            timeout=httpx2.Timeout(timeout_s + CLOSE_GRACE_S, connect=min(timeout_s, CONNECT_TIMEOUT_S)),
            transport=_CappedTransport(budget),
        )
        transport = streamable_http_client(self.url, http_client=client, max_sse_event_size=budget.limit)
        async with client, transport as streams:
            yield streams


class MCPServerStdio(MCPServer):
    """A local server: ``command`` (the program and its arguments) started for each exchange, spoken to over its
    stdin and stdout, and stopped (and reaped) when the exchange ends. It inherits only a safe part of this
    process's environment (``PATH``, ``HOME``, ...) plus ``env``. The command is the server's configuration (code or
    the agents file), never anything a request sends."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        name: str | None = None,
        **kw: Any,
    ):
        if not command:
            raise ValueError("command must name a program")
        super().__init__(name=name or command[0], **kw)
        self.command = list(command)
        self.env = dict(env or {})
        self.cwd = cwd

    def __repr__(self) -> str:
        return f"<MCPServerStdio {self.command[0]}>"

    def connect(self, budget: _ByteBudget, timeout_s: float) -> AbstractAsyncContextManager[Any]:
        from mcp.client.stdio import StdioServerParameters, stdio_client

        params = StdioServerParameters(command=self.command[0], args=self.command[1:], env=self.env, cwd=self.cwd)
        return stdio_client(params)


# -- the tool -----------------------------------------------------------------------------------------------------


class MCPTool(FunctionTool):
    """One tool of an MCP server: its input schema is the parameters the model sees and what its arguments are
    validated against (JSON Schema, as the server declared it) before the server is called."""

    def __init__(self, server: MCPServer, tool: mcp_types.Tool) -> None:
        policy = server.policies.get(tool.name, MCPToolPolicy())
        name = server.prefix + tool.name
        if not TOOL_NAME.match(name):
            raise ValueError(f"{name!r} is not a name models accept (letters, digits, _ and -, at most 64)")
        if name in COMPANION_TOOLS:
            raise ValueError(f"{name!r} is a built-in tool name")
        schema = dict(tool.input_schema or {})
        schema.setdefault("type", "object")
        schema.setdefault("properties", {})
        if schema["type"] != "object":
            raise ValueError("its input schema is not of type 'object'")
        if CONFIRM_FIELD in schema["properties"] and policy.on_duplicate == "confirm":
            raise ValueError(f"{CONFIRM_FIELD!r} is reserved (on_duplicate='confirm' adds it)")
        validator_class = jsonschema.validators.validator_for(schema)
        validator_class.check_schema(schema)
        _check_refs(schema, validator_class)
        self.server = server
        self.remote_name = tool.name
        self.input_schema = schema
        self._validator = validator_class(schema, registry=NO_REMOTE_REFS)
        self.timeout_s = policy.timeout_s or server.timeout_s
        description = tool.description or tool.title or ""
        # a policy of its own, without the timeout: the executor compares policies field by field
        base = ToolPolicy(**policy.model_dump(exclude={"timeout_s"}))
        super().__init__(self.invoke, name=name, description=description, policy=base)

    def __repr__(self) -> str:
        return f"<MCPTool {self.name} of {self.server.name}>"

    def _build_model(self) -> tuple[str | None, type[BaseModel]]:
        # every field is checked by the JSON Schema (``parse_arguments``); the model only carries the arguments
        fields: dict[str, Any] = {}
        if self.policy.on_duplicate == "confirm":
            fields[CONFIRM_FIELD] = (bool, False)
        validate = self._check

        class Arguments(BaseModel):
            model_config = ConfigDict(extra="allow")

            @model_validator(mode="before")
            @classmethod
            def _schema(cls, data: Any) -> Any:
                return validate(data)

        return None, create_model(f"{self.name}_arguments", __base__=Arguments, **fields)

    def _check(self, data: Any) -> Any:
        if not isinstance(data, dict):
            raise ValueError("arguments must be an object")
        args = {k: v for k, v in data.items() if k != CONFIRM_FIELD}
        try:
            error = jsonschema.exceptions.best_match(self._validator.iter_errors(args))
        except referencing.exceptions.Unresolvable as err:
            raise ValueError(f"the tool's schema has a reference that does not resolve ({err})") from None
        if error is not None:
            where = ".".join(str(p) for p in error.absolute_path)
            raise ValueError(f"{where}: {error.message}" if where else error.message)
        return data

    @property
    def parameters(self) -> dict[str, Any]:
        schema = copy.deepcopy(self.input_schema)
        if self.policy.on_duplicate == "confirm":
            schema["properties"][CONFIRM_FIELD] = {"type": "boolean", "default": False}
        return schema

    def parse_arguments(self, raw: dict[str, Any]) -> dict[str, Any]:
        """Validate against the server's schema (a ``null`` for an optional argument that does not take null
        is dropped: models send null for "not given"); raises ``ValidationError``."""
        parsed = self.args_model.model_validate(self._without_unset_nulls(raw))
        return dict(parsed.model_extra or {}) | {k: getattr(parsed, k) for k in type(parsed).model_fields}

    def _without_unset_nulls(self, raw: dict[str, Any]) -> dict[str, Any]:
        required = set(self.input_schema.get("required", ()))
        props = self.input_schema["properties"]
        return {
            k: v for k, v in raw.items() if v is not None or k in required or k not in props or self._valid(props[k], v)
        }

    def _valid(self, schema: Any, value: Any) -> bool:
        try:
            return bool(self._validator.evolve(schema=schema).is_valid(value))
        except referencing.exceptions.Unresolvable:
            return False  # kept, and refused by the validation proper

    async def invoke(self, ctx: RunContext, arguments: dict[str, Any]) -> Any:
        args = {k: v for k, v in arguments.items() if k != CONFIRM_FIELD}
        limit = _ProgressLimit()

        async def progress(progress: float, total: float | None, message: str | None) -> None:
            if limit.allows(time.monotonic()):  # each update is a chat pair and an event: a server cannot flood them
                await ctx.update(*_progress(progress, total, message))

        import mcp_types

        async def call(session: ClientSession) -> mcp_types.CallToolResult:
            # only the request waits on the cancellation: cancelled, it tells the server (``notifications/cancelled``)
            # while the connection is still open to carry it
            request = session.call_tool(self.remote_name, args, progress_callback=progress)
            result = await ctx.wait_if_not_cancelled(request)
            assert isinstance(result, mcp_types.CallToolResult)
            return result

        what = f"the call of {self.remote_name} failed"
        result = await self.server.exchange(call, self.timeout_s, what=what)
        text = render_result(result)
        if result.is_error:
            raise ToolError(text or f"{self.name} failed (its MCP server gave no reason).")
        return text


class _ProgressLimit:
    """The progress of one call that becomes updates (a token bucket): ``PROGRESS_BURST`` at once, then one per
    ``PROGRESS_INTERVAL_S``, at most ``MAX_PROGRESS_UPDATES`` in all; the rest are dropped."""

    def __init__(self) -> None:
        self.sent = 0
        self.tokens = float(PROGRESS_BURST)
        self.last_at: float | None = None

    def allows(self, now: float) -> bool:
        if self.last_at is not None:
            self.tokens = min(PROGRESS_BURST, self.tokens + (now - self.last_at) / PROGRESS_INTERVAL_S)
        self.last_at = now
        if self.sent >= MAX_PROGRESS_UPDATES or self.tokens < 1:
            return False
        self.sent, self.tokens = self.sent + 1, self.tokens - 1
        return True


def _check_refs(schema: dict[str, Any], validator_class: Any) -> None:
    """Raise ``ValueError`` unless every reference in ``schema`` points inside it and resolves there."""
    dialect = schema.get("$schema") or validator_class.META_SCHEMA.get("$id", "")
    specification = referencing.jsonschema.specification_with(dialect, default=referencing.jsonschema.DRAFT202012)
    resolver = NO_REMOTE_REFS.resolver_with_root(specification.create_resource(schema))
    for ref in _refs(schema):
        if not ref.startswith("#"):
            raise ValueError("its input schema refers outside itself (only references inside it are followed)")
        try:
            resolver.lookup(ref)
        except referencing.exceptions.Unresolvable:
            raise ValueError(f"its input schema's reference {ref[:DETAIL_MAX_CHARS]!r} does not resolve") from None


def _refs(node: Any) -> Iterable[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in REF_KEYWORDS and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _progress(done: float, total: float | None, message: str | None) -> tuple[str, float | None]:
    """An MCP progress notification as a ``ctx.update()``: its message (or the count) and a fraction when the
    server gave a total."""
    fraction = min(max(done / total, 0.0), 1.0) if total and math.isfinite(done / total) else None
    text = message or (f"{done:g} of {total:g}" if total else f"{done:g}")
    return text, fraction


def render_result(result: mcp_types.CallToolResult) -> str:
    """A tool result as the output's text: its text blocks, in order; other blocks named; the structured content as
    JSON when there is no text."""
    import mcp_types

    parts: list[str] = []
    for block in result.content:
        if isinstance(block, mcp_types.TextContent):
            parts.append(block.text)
        elif isinstance(block, mcp_types.EmbeddedResource) and isinstance(
            block.resource, mcp_types.TextResourceContents
        ):
            parts.append(block.resource.text)
        elif isinstance(block, mcp_types.ResourceLink):
            parts.append(f"[resource: {block.uri}]")
        else:
            parts.append(f"[{block.type} content not shown]")
    if not any(parts) and result.structured_content is not None:
        return json.dumps(result.structured_content)
    return "\n".join(parts)


def _without_secrets(url: str) -> str:
    """``url`` without its user, password, query and fragment (what logs and the model may see of it)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _first_leaf(err: BaseException) -> BaseException:
    """The error itself, or the first one inside an exception group of the SDK's task groups."""
    while isinstance(err, BaseExceptionGroup) and err.exceptions:
        err = err.exceptions[0]
    return err


def _describe(err: BaseException) -> str:
    if isinstance(err, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in err.exceptions)
    text = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    return text[:DETAIL_MAX_CHARS]


__all__ = ["MCPServer", "MCPServerHTTP", "MCPServerStdio", "MCPTool", "MCPToolPolicy"]
