"""The MCP tools: each one is a REST operation, its arguments validated here and sent on as that operation's request.

A tool is a name, a description, an input model (the limits of the REST operation: page sizes, id lengths; the text
limit is the server's ``MAX_TEXT_CHARS``, added to the schema where it is built) and hints for the client, and a
function turning its validated arguments into the REST request (``RestCall``). Nothing here runs a command: the
REST route does, as for any caller (``server``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field

from ..idempotency import MAX_KEY_LEN
from ..schemas import CHAT_PAGE_MAX, MAX_SESSIONS_PAGE, SESSION_ID_PATTERN, TOOL_CALL_PAGE_MAX, SessionStateFilter

CALL_ID_MAX_CHARS = 200  # the model's, or the server's
CURSOR_MAX_CHARS = 400

# an id is one segment of the REST path: a "/" in it would name another operation
SessionId = Annotated[str, Field(pattern=SESSION_ID_PATTERN, description="The session's id.")]
Cursor = Annotated[
    str | None, Field(default=None, max_length=CURSOR_MAX_CHARS, description="`next_cursor` of the previous page.")
]
IdempotencyKey = Annotated[
    str | None,
    Field(
        default=None,
        min_length=1,
        max_length=MAX_KEY_LEN,
        description="Sent as the `Idempotency-Key` header: a retry with the same key is applied at most once.",
    ),
]
ToolStatusFilter = Literal["running", "cancelling", "completed", "failed", "cancelled", "rejected", "interrupted"]


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ListSessionsArgs(_Args):
    state: SessionStateFilter | None = None
    agent: str | None = Field(default=None, min_length=1, max_length=100, description="The agent it started with.")
    cursor: Cursor = None
    limit: int = Field(default=50, ge=1, le=MAX_SESSIONS_PAGE)


class AttentionArgs(_Args):
    agent: str | None = Field(default=None, min_length=1, max_length=100, description="The agent it started with.")
    limit: int = Field(default=50, ge=1, le=MAX_SESSIONS_PAGE)


class SessionArgs(_Args):
    session_id: SessionId


class TranscriptArgs(_Args):
    session_id: SessionId
    cursor: Cursor = None
    limit: int = Field(default=200, ge=1, le=CHAT_PAGE_MAX)


class InputArgs(_Args):
    session_id: SessionId
    text: str = Field(min_length=1, description="What the user says.")
    interrupt: bool = Field(default=True, description="Interrupt the current speech if it allows it.")
    force: bool = Field(default=False, description="Interrupt it even if it does not.")
    reply: bool = Field(default=True, description="Have the agent answer.")
    idempotency_key: IdempotencyKey = None


class SayArgs(_Args):
    session_id: SessionId
    text: str = Field(min_length=1, description="What the agent says, verbatim.")
    allow_interruptions: bool = True
    add_to_chat: bool = True
    idempotency_key: IdempotencyKey = None


class InterruptArgs(_Args):
    session_id: SessionId
    force: bool = Field(default=False, description="Interrupt speeches that do not allow interruptions too.")
    idempotency_key: IdempotencyKey = None


class CloseArgs(_Args):
    session_id: SessionId


class ToolCallsArgs(_Args):
    session_id: SessionId
    status: ToolStatusFilter | None = None
    cursor: Cursor = None
    limit: int = Field(default=200, ge=1, le=TOOL_CALL_PAGE_MAX)


class RunningToolCallsArgs(_Args):
    cursor: Cursor = None
    limit: int = Field(default=200, ge=1, le=TOOL_CALL_PAGE_MAX)


class ToolCallArgs(_Args):
    session_id: SessionId
    # no "/" and not "." or "..": a URL's dot segments would name another REST path even quoted (they are removed)
    call_id: str = Field(
        max_length=CALL_ID_MAX_CHARS,
        pattern=r"^(?:[^/.][^/]*|\.[^/.][^/]*|\.\.[^/]+)$",
        description="The tool call's id.",
    )


class CancelArgs(ToolCallArgs):
    force: bool = Field(default=False, description="Cancel even while the speech that made the call forbids it.")
    idempotency_key: IdempotencyKey = None


@dataclass(frozen=True, slots=True)
class RestCall:
    """The REST request a tool call makes."""

    method: str
    path: str
    params: dict[str, Any] = field(default_factory=dict)
    body: dict[str, Any] | None = None
    idempotency_key: str | None = None


@dataclass(frozen=True, slots=True)
class Hints:
    """What a tool does, as MCP's tool annotations say it to a client (the protocol's own type is built from it when
    the MCP server first serves: this module is imported with the application, the SDK only when ``/mcp`` is used)."""

    read_only: bool
    destructive: bool | None = None
    idempotent: bool | None = None
    open_world: bool = False


@dataclass(frozen=True, slots=True)
class McpTool:
    name: str
    title: str
    description: str
    operation: str  # the REST operation's id in the OpenAPI document
    scope: str
    args: type[_Args]
    annotations: Hints
    request: Callable[[Any], RestCall]
    text_limited: bool = False  # its `text` is bounded by MAX_TEXT_CHARS


def _session(sid: str, tail: str = "") -> str:
    return f"/v1/sessions/{quote(sid, safe='')}{tail}"


def _query(args: _Args, *names: str) -> dict[str, Any]:
    return {name: value for name in names if (value := getattr(args, name)) is not None}


READ = Hints(read_only=True)


def _command(*, destructive: bool, idempotent: bool) -> Hints:
    return Hints(read_only=False, destructive=destructive, idempotent=idempotent)


def _list_sessions(a: ListSessionsArgs) -> RestCall:
    return RestCall("GET", "/v1/sessions", _query(a, "state", "agent", "cursor", "limit"))


def _attention(a: AttentionArgs) -> RestCall:
    return RestCall("GET", "/v1/sessions", {"attention": "true", **_query(a, "agent", "limit")})


def _get_session(a: SessionArgs) -> RestCall:
    return RestCall("GET", _session(a.session_id))


def _transcript(a: TranscriptArgs) -> RestCall:
    return RestCall("GET", _session(a.session_id, "/chat"), _query(a, "cursor", "limit"))


def _input(a: InputArgs) -> RestCall:
    body = {"text": a.text, "interrupt": a.interrupt, "force": a.force, "reply": a.reply}
    return RestCall("POST", _session(a.session_id, "/input"), body=body, idempotency_key=a.idempotency_key)


def _say(a: SayArgs) -> RestCall:
    body = {"text": a.text, "allow_interruptions": a.allow_interruptions, "add_to_chat": a.add_to_chat}
    return RestCall("POST", _session(a.session_id, "/say"), body=body, idempotency_key=a.idempotency_key)


def _interrupt(a: InterruptArgs) -> RestCall:
    return RestCall(
        "POST", _session(a.session_id, "/interrupt"), body={"force": a.force}, idempotency_key=a.idempotency_key
    )


def _close(a: CloseArgs) -> RestCall:
    return RestCall("DELETE", _session(a.session_id))


def _tool_calls(a: ToolCallsArgs) -> RestCall:
    return RestCall("GET", _session(a.session_id, "/tool-calls"), _query(a, "status", "cursor", "limit"))


def _running(a: RunningToolCallsArgs) -> RestCall:
    return RestCall("GET", "/v1/tool-calls", {"status": "running", **_query(a, "cursor", "limit")})


def _tool_call(a: ToolCallArgs) -> RestCall:
    return RestCall("GET", _session(a.session_id, f"/tool-calls/{quote(a.call_id, safe='')}"))


def _cancel(a: CancelArgs) -> RestCall:
    path = _session(a.session_id, f"/tool-calls/{quote(a.call_id, safe='')}/cancel")
    return RestCall("POST", path, body={"force": a.force}, idempotency_key=a.idempotency_key)


TOOLS: tuple[McpTool, ...] = (
    McpTool(
        "list_sessions",
        "List sessions",
        "Sessions, newest first, optionally by state and agent, a page at a time (`next_cursor`).",
        "listSessions",
        "sessions:read",
        ListSessionsArgs,
        READ,
        _list_sessions,
    ),
    McpTool(
        "sessions_needing_attention",
        "Sessions needing attention",
        "The sessions that need an operator, each with its `attention` reasons, the longest waiting first.",
        "listSessions",
        "sessions:read",
        AttentionArgs,
        READ,
        _attention,
    ),
    McpTool(
        "get_session",
        "Read a session",
        "One session: its agent, state, what the agent is doing, its current speech.",
        "getSession",
        "sessions:read",
        SessionArgs,
        READ,
        _get_session,
    ),
    McpTool(
        "read_transcript",
        "Read a transcript",
        "The session's chat in conversation order (messages, tool calls and their outputs), a page at a time.",
        "getChat",
        "sessions:read",
        TranscriptArgs,
        READ,
        _transcript,
    ),
    McpTool(
        "inject_input",
        "Inject user input",
        "Say `text` as the user: it interrupts the current speech (if that allows it, or with `force`) and the "
        "agent answers. Returns at once with the ids of the input and of the reply's speech.",
        "injectInput",
        "sessions:control",
        InputArgs,
        _command(destructive=False, idempotent=False),
        _input,
        text_limited=True,
    ),
    McpTool(
        "say",
        "Make the agent say something",
        "Have the agent say `text` verbatim, after anything already queued.",
        "say",
        "sessions:control",
        SayArgs,
        _command(destructive=False, idempotent=False),
        _say,
        text_limited=True,
    ),
    McpTool(
        "interrupt",
        "Interrupt the agent",
        "Interrupt the current speech (and the queued ones up to the first that does not allow it; `force`: all). "
        "Returns once what was heard is committed.",
        "interrupt",
        "sessions:control",
        InterruptArgs,
        _command(destructive=True, idempotent=False),
        _interrupt,
    ),
    McpTool(
        "close_session",
        "Close a session",
        "End the session: stop speaking, cancel cancellable tool calls, await the others.",
        "closeSession",
        "sessions:write",
        CloseArgs,
        _command(destructive=True, idempotent=True),
        _close,
    ),
    McpTool(
        "list_tool_calls",
        "List a session's tool calls",
        "The session's tool calls by start time, optionally by status, with their progress and outputs.",
        "listToolCalls",
        "sessions:read",
        ToolCallsArgs,
        READ,
        _tool_calls,
    ),
    McpTool(
        "list_running_tool_calls",
        "List running tool calls",
        "Running tool calls across every live session, oldest first.",
        "listRunningToolCalls",
        "sessions:read",
        RunningToolCallsArgs,
        READ,
        _running,
    ),
    McpTool(
        "get_tool_call",
        "Read a tool call",
        "One tool call with its progress updates and output.",
        "getToolCall",
        "sessions:read",
        ToolCallArgs,
        READ,
        _tool_call,
    ),
    McpTool(
        "cancel_tool_call",
        "Cancel a tool call",
        "Cancel a running, cancellable tool call; returns once it has ended `cancelled`, or is `cancelling` (its tool "
        "ignored the cancellation and still runs; it ends `cancelled` when the tool returns).",
        "cancelToolCall",
        "tools:cancel",
        CancelArgs,
        _command(destructive=True, idempotent=True),
        _cancel,
    ),
)

BY_NAME = {tool.name: tool for tool in TOOLS}


def input_schema(tool: McpTool, max_text_chars: int) -> dict[str, Any]:
    """The JSON schema of ``tool``'s arguments, with the server's text limit."""
    schema = tool.args.model_json_schema()
    if tool.text_limited:
        schema["properties"]["text"]["maxLength"] = max_text_chars
    return schema
