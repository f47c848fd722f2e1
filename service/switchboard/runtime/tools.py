"""Function tools: the decorator, the JSON schema from type hints, and the RunContext a tool receives."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import json
import typing
import weakref
from collections.abc import Awaitable, Callable
from datetime import date, datetime, time
from decimal import Decimal
from enum import Enum, StrEnum
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, overload
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from .aio import first_of
from .chat import FunctionCall
from .text import valid_text

if TYPE_CHECKING:
    from .receipt import Receipt
    from .speech import SpeechHandle

T = TypeVar("T")

OnDuplicate = Literal["allow", "reject", "replace", "confirm"]
DuplicateScope = Literal["name", "name_and_args"]
OnRestart = Literal["fail", "retry", "resume"]
ToolScope = Literal["agent", "session"]
# why a call made by a speculative reply was dropped with it (``tool.ended``'s ``reason``): the user went on speaking
# (``turn_resumed``), the final input interrupted a speech and changed the context (``barge_in``), something else was
# added to the context (``context_changed``), or the session closed or stopped here (``session_stopped``)
DropReason = Literal["turn_resumed", "barge_in", "context_changed", "session_stopped"]

CONFIRM_FIELD = "confirm_duplicate"
_PARAMETERS: weakref.WeakKeyDictionary[type[BaseModel], dict[str, Any]] = weakref.WeakKeyDictionary()
CONFIRM_DESCRIPTION = (
    "Set to true only after the user confirmed running this again while an identical call is still in progress."
)


class ToolPolicy(BaseModel):
    """How the executor treats the calls of one tool (``@function_tool`` and webhook tools take the same fields).

    - ``on_duplicate``: a call while an identical one is still running is run too (``allow``), refused
      (``reject``), run after cancelling the older one (``replace``), or refused until the model sets
      ``confirm_duplicate`` (``confirm``); ``duplicate_scope`` says whether "identical" means the same name or the
      same name and arguments.
    - ``allow_cancellation``: a running call may be cancelled (over REST, or by the model's companion tools).
    - ``on_restart``: a call still running when its session stopped here (a crash, a restart, a move to another node)
      ends ``interrupted`` (``fail``), runs again (``retry``: its work is done a second time), or goes on where it was
      (``resume``: its body runs again told so, ``ctx.resumed``, to wait for work under way elsewhere rather than start
      it again; only for a tool that can resume, such as a webhook tool, whose default it is).
    - ``scope``: ``session`` calls go on across an agent handoff; a handoff first ends the ``agent`` calls
      (cancelling the cancellable ones, waiting for the others).
    - ``side_effects``: ``False`` declares the tool free of side effects (a lookup, a quote): a speculative reply
      (preemptive generation) may start its calls before the user's turn is confirmed. A call of any other tool in a
      speculative reply waits until the reply is confirmed (``docs/agents.md``, "Tools that are safe to run early").
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    on_duplicate: OnDuplicate = "allow"
    duplicate_scope: DuplicateScope = "name"
    allow_cancellation: bool = False
    on_restart: OnRestart = "fail"
    scope: ToolScope = "agent"
    side_effects: bool = True


DEFAULT_POLICY = ToolPolicy()


class ToolStatus(StrEnum):
    RUNNING = "running"
    # cancelled, but its tool ignores cancellation: still running (it can still act) until its body returns
    CANCELLING = "cancelling"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    INTERRUPTED = "interrupted"


#: a call in one of these has not ended: it is listed among the running ones
RUNNING_STATUSES = frozenset({ToolStatus.RUNNING, ToolStatus.CANCELLING})
TERMINAL_STATUSES = frozenset(s for s in ToolStatus if s not in RUNNING_STATUSES)


class ToolError(Exception):
    """An expected failure: the message goes to the model as an ``is_error`` output; no traceback is logged."""


class StopResponse(Exception):
    """Ends the tool call without a tool reply from the model."""


class ToolCancelled(Exception):
    """Raised by ``RunContext.wait_if_not_cancelled`` when the call was cancelled meanwhile."""


class ProgressUpdate(BaseModel):
    message: str
    progress: float | None = None
    at: datetime


ToolCallKey = tuple[datetime, str]  # (started_at, call_id): where a call stands in its session's list


class ToolCallInfo(BaseModel):
    """The lifecycle record of one tool call (persisted, and what the API shows)."""

    call_id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    status: ToolStatus = ToolStatus.RUNNING
    cancellable: bool = False
    scope: ToolScope = "agent"
    background: bool = False
    progress: list[ProgressUpdate] = Field(default_factory=list)
    output: str | None = None
    is_error: bool = False
    error: str | None = None  # why it failed, for observers (redacted); the model gets ``output``
    speech_id: str | None = None
    agent: str | None = None
    # made by a speculative reply not confirmed yet: nothing of it reaches the chat unless its reply is confirmed
    speculative: bool = False
    started_at: datetime
    ended_at: datetime | None = None

    @property
    def ended(self) -> bool:
        return self.status in TERMINAL_STATUSES

    def listed_as(self, status: ToolStatus | None) -> bool:
        """Whether a listing filtered by ``status`` shows this call: ``running`` shows every call not ended yet
        (``cancelling`` ones too: they can still act), any other status only its own calls, None every call."""
        if status is ToolStatus.RUNNING:
            return not self.ended
        return status is None or self.status == status

    @property
    def order_key(self) -> ToolCallKey:
        return (self.started_at, self.call_id)


def _describe(fn: Callable[..., Any]) -> str:
    doc = inspect.getdoc(fn) or ""
    return doc.split("\n\n", 1)[0].replace("\n", " ").strip()


def _strip_titles(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _strip_titles(v) for k, v in schema.items() if k != "title"}
    if isinstance(schema, list):
        return [_strip_titles(v) for v in schema]
    return schema


class FunctionTool:
    """A tool the model can call. Created by ``@function_tool``; binds like a method when defined on an Agent."""

    #: Whether a call of this tool can go on after its session stopped where it ran (``on_restart="resume"``): its
    #: body, run again with ``ctx.resumed``, picks up the work under way instead of starting it again.
    can_resume: bool = False

    def __init__(
        self,
        fn: Callable[..., Awaitable[Any]],
        *,
        name: str | None = None,
        description: str | None = None,
        policy: ToolPolicy = DEFAULT_POLICY,
        timeout_s: float | None = None,
        instance: Any = None,
    ) -> None:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"function tool {fn.__qualname__} must be an async function")
        self.fn = fn
        self.name = name or fn.__name__
        self.description = description if description is not None else _describe(fn)
        self.policy = policy
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"tool {self.name}: timeout_s must be a positive number of seconds")
        #: past this many seconds a call is stopped and ends ``failed`` (None: no limit; a webhook or MCP tool bounds
        #: its calls itself)
        self.call_timeout_s = timeout_s
        self._instance = instance
        if policy.on_restart == "resume" and not self.can_resume:
            raise ValueError(
                f"tool {self.name}: on_restart='resume' needs a tool that can resume its calls (a webhook tool); "
                "use 'fail' or 'retry'"
            )
        self._ctx_param, self.args_model = self._build_model()

    def __repr__(self) -> str:
        return f"<FunctionTool {self.name}>"

    def _build_model(self) -> tuple[str | None, type[BaseModel]]:
        sig = inspect.signature(self.fn)
        hints = typing.get_type_hints(self.fn)
        ctx_param: str | None = None
        fields: dict[str, Any] = {}
        params = list(sig.parameters.values())
        if params and params[0].name == "self":
            params = params[1:]
        for p in params:
            hint = hints.get(p.name, Any)
            if hint is RunContext or (p.name in ("ctx", "context") and hint is Any):
                ctx_param = p.name
                continue
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"function tool {self.name}: *args/**kwargs are not supported")
            default = ... if p.default is p.empty else p.default
            fields[p.name] = (hint, default)
        if self.policy.on_duplicate == "confirm":
            fields[CONFIRM_FIELD] = (
                bool,
                Field(default=False, description=CONFIRM_DESCRIPTION),
            )
        model = create_model(f"{self.name}_arguments", __config__=ConfigDict(extra="forbid"), **fields)
        return ctx_param, typing.cast(type[BaseModel], model)

    def __get__(self, instance: Any, owner: type | None = None) -> FunctionTool:
        if instance is None or self._instance is not None:
            return self
        bound = object.__new__(FunctionTool)
        bound.__dict__.update(self.__dict__)
        bound._instance = instance
        return bound

    @property
    def parameters(self) -> dict[str, Any]:
        # Generated once per arguments model, shared by every bound copy of the tool: pydantic's schema generation
        # is slow and leaves cyclic garbage. A copy is returned so that no caller can change it for later requests.
        schema = _PARAMETERS.get(self.args_model)
        if schema is None:
            schema = _strip_titles(self.args_model.model_json_schema())
            schema.setdefault("properties", {})
            _PARAMETERS[self.args_model] = schema
        return copy.deepcopy(schema)

    def schema(self) -> dict[str, Any]:
        """OpenAI-style function description."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    def parse_arguments(self, raw: dict[str, Any]) -> dict[str, Any]:
        """Validate the model's arguments; raises ``ValidationError``."""
        parsed = self.args_model.model_validate(raw)
        return {name: getattr(parsed, name) for name in type(parsed).model_fields}

    async def invoke(self, ctx: RunContext, arguments: dict[str, Any]) -> Any:
        kwargs = {k: v for k, v in arguments.items() if k != CONFIRM_FIELD}
        if self._ctx_param is not None:
            kwargs[self._ctx_param] = ctx
        if self._instance is not None:
            return await self.fn(self._instance, **kwargs)
        return await self.fn(**kwargs)


@overload
def function_tool(fn: Callable[..., Awaitable[Any]], /) -> FunctionTool: ...


@overload
def function_tool(
    *,
    name: str | None = None,
    description: str | None = None,
    on_duplicate: OnDuplicate = "allow",
    duplicate_scope: DuplicateScope = "name",
    allow_cancellation: bool = False,
    on_restart: OnRestart = "fail",
    scope: ToolScope = "agent",
    side_effects: bool = True,
    timeout_s: float | None = None,
) -> Callable[[Callable[..., Awaitable[Any]]], FunctionTool]: ...


def function_tool(
    fn: Callable[..., Awaitable[Any]] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    on_duplicate: OnDuplicate = "allow",
    duplicate_scope: DuplicateScope = "name",
    allow_cancellation: bool = False,
    on_restart: OnRestart = "fail",
    scope: ToolScope = "agent",
    side_effects: bool = True,
    timeout_s: float | None = None,
) -> FunctionTool | Callable[[Callable[..., Awaitable[Any]]], FunctionTool]:
    """Declare a tool. Used bare (``@function_tool``) or called (``@function_tool(on_duplicate="reject")``).

    The docstring's first paragraph is the description for the model; parameters and their JSON schema come from
    the type hints. A parameter annotated ``RunContext`` receives the call's context. ``timeout_s``: a call still
    running that long after it started is stopped (its body cancelled, ``ctx.cancel_reason`` is ``timed out``) and
    ends ``failed`` with an output saying so, which the model answers. The other keyword arguments are the tool's
    ``ToolPolicy``.
    """

    policy = ToolPolicy(
        on_duplicate=on_duplicate,
        duplicate_scope=duplicate_scope,
        allow_cancellation=allow_cancellation,
        on_restart=on_restart,
        scope=scope,
        side_effects=side_effects,
    )

    def wrap(f: Callable[..., Awaitable[Any]]) -> FunctionTool:
        return FunctionTool(f, name=name, description=description, policy=policy, timeout_s=timeout_s)

    return wrap(fn) if fn is not None else wrap


def format_validation_error(tool: str, err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        field = ".".join(str(x) for x in e["loc"]) or "(arguments)"
        parts.append(f"{field}: {e['msg']}")
    return f"Invalid arguments for {tool}: " + "; ".join(parts)


#: The most of a tool's output that is kept; the rest is cut, and the cut is marked so the model and readers see it.
MAX_TOOL_OUTPUT_CHARS = 16_000
# a progress update is a status line; up to ``PROGRESS_KEPT`` of them stay on the call's record, and each one is a
# pair the model sees
MAX_PROGRESS_CHARS = 1_000
TRUNCATION_MARKER = "\n[output truncated: {dropped} more characters not shown]"


def capped_output(text: str, limit: int = MAX_TOOL_OUTPUT_CHARS) -> str:
    """``text``, or its first ``limit`` characters followed by a marker that says how much was cut."""
    if len(text) <= limit:
        return text
    return text[:limit] + TRUNCATION_MARKER.format(dropped=len(text) - limit)


class UnusableResult(TypeError):
    """A tool returned something that cannot be given to the model as text (an arbitrary object)."""


def render_output(value: Any) -> str:
    """A tool's result as the text of its output, valid Unicode (``runtime.text``: a lone surrogate becomes U+FFFD).

    Text, ``None``, pydantic models, and JSON values (numbers, booleans, lists, dicts with text keys) made of
    those, dates, times, UUIDs, decimals, enums and dataclasses. Anything else raises ``UnusableResult``: its
    ``repr`` would tell the model nothing it can use.
    """
    return valid_text(_render(value))


def _render(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    try:
        return json.dumps(value, default=_json_value)
    except ValueError as err:  # a circular reference, or a float JSON cannot write
        raise UnusableResult(f"the result cannot be written as JSON ({err})") from None


def _json_value(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    if isinstance(value, (UUID, Decimal)):
        return str(value)
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise UnusableResult(f"a value of type {type(value).__name__} cannot be given to the model")


class SessionControl(Protocol):
    """What a tool reaches of its session through ``ctx.session`` (``AgentSession`` implements it)."""

    @property
    def id(self) -> str: ...

    async def say(
        self, text: str, *, allow_interruptions: bool = ..., add_to_chat: bool = ..., priority: int = ...
    ) -> SpeechHandle:
        """Speak ``text`` as is, after whatever is queued (this call's own reply included) with the same or a
        higher priority."""
        ...

    async def generate_reply(self, *, instructions: str | None = ..., priority: int = ...) -> SpeechHandle:
        """Queue a reply from the model, after whatever is queued with the same or a higher priority."""
        ...

    async def interrupt(self, *, force: bool = False) -> SpeechHandle | None:
        """Interrupt the current speech; returns once its interrupted message is committed."""
        ...


class CallControl(Protocol):
    """What a tool's ``RunContext`` drives: one running call (the executor's ``RunningCall`` implements it)."""

    @property
    def call_id(self) -> str: ...

    @property
    def item(self) -> FunctionCall: ...

    @property
    def session_id(self) -> str: ...

    @property
    def speech(self) -> SpeechHandle | None: ...

    @property
    def started_at(self) -> datetime:
        """When the call started (its first run's start, for a resumed call)."""
        ...

    @property
    def resumed(self) -> bool:
        """This run resumes a call an earlier run left running (``on_restart="resume"``)."""
        ...

    @property
    def userdata(self) -> dict[str, Any]: ...

    @property
    def session(self) -> SessionControl | None: ...

    @property
    def cancel_fut(self) -> asyncio.Future[None]:
        """Resolved when the call is cancelled (cooperative cancellation)."""
        ...

    @property
    def cancel_reason(self) -> str | None:
        """Why the call was cancelled (who cancelled it), once it was."""
        ...

    async def report_progress(
        self,
        message: str,
        progress: float | None,
        receipt: Receipt[ToolCallInfo] | None = None,
        *,
        silent: bool = False,
    ) -> None: ...

    def receipt_on_end(self, receipt: Receipt[ToolCallInfo]) -> None:
        """The call's end completes ``receipt`` (the command that decides it: a reported result)."""
        ...

    async def wait_for_playout(self) -> None: ...


class RunContext:
    """What a running tool sees: its call, its speech, progress, playout and cancellation."""

    def __init__(self, call: CallControl) -> None:
        self._call = call

    @property
    def call_id(self) -> str:
        return self._call.call_id

    @property
    def function_call(self) -> FunctionCall:
        return self._call.item

    @property
    def session_id(self) -> str:
        return self._call.session_id

    @property
    def speech(self) -> SpeechHandle | None:
        """The speech whose generation produced this call (None for recovered calls re-run after a restart)."""
        return self._call.speech

    @property
    def speech_handle(self) -> SpeechHandle | None:
        """The same as ``speech`` (the name LiveKit Agents uses)."""
        return self._call.speech

    @property
    def started_at(self) -> datetime:
        """When the call started: for a resumed call, when its first run started (on whichever node that was)."""
        return self._call.started_at

    @property
    def resumed(self) -> bool:
        """True when this run resumes a call that its session left running when it stopped where it ran (a crash,
        a restart, a move to another node) and whose tool is declared ``on_restart="resume"``: the call's work was
        started by the earlier run, so pick it up (wait for its result) rather than start it again."""
        return self._call.resumed

    @property
    def session(self) -> SessionControl:
        """The session the call runs in: ``say()``, ``generate_reply()`` and ``interrupt()`` from inside a tool.

        What it queues plays after the reply that made this call, and that reply waits for this call while it
        runs in the foreground: a tool that waits for the playout of a speech it queued must first move to the
        background (``ctx.update()``), or the wait raises ``CircularWait`` at once.
        """
        session = self._call.session
        if session is None:
            raise RuntimeError("this tool call runs outside of a session")
        return session

    @property
    def userdata(self) -> dict[str, Any]:
        """Per-session scratch space shared by all tools and agents of the session."""
        return self._call.userdata

    @property
    def cancelled(self) -> bool:
        return self._call.cancel_fut.done()

    @property
    def cancel_reason(self) -> str | None:
        """Why the call was cancelled, once it was: who asked (``cancelled by an operator``, ``cancelled at the
        user's request``, ``replaced by call_2``, ``agent handoff``, ``session closed``), as the chat says it."""
        return self._call.cancel_reason if self.cancelled else None

    async def update(
        self,
        message: str,
        progress: float | None = None,
        *,
        silent: bool = False,
        receipt: Receipt[ToolCallInfo] | None = None,
    ) -> None:
        """Report progress. The first update moves the call to the background: the reply goes on without it, and
        its next step answers the update (with tools off: the model cannot call the tool again to poll it).

        ``silent``: the update is recorded and reported (``tool.progress``, the call's record, the chat) but asks for
        no spoken reply: a first update that is silent moves the call to the background without a step that answers
        it. Updates of one call are written one at a time, in order; one made once the call has ended is ignored.
        ``receipt``: an idempotent command's (a progress report from a webhook backend), completed by the update's
        commit.
        """
        if progress is not None and not 0.0 <= progress <= 1.0:
            raise ValueError("progress must be between 0 and 1")
        await self._call.report_progress(valid_text(message), progress, receipt, silent=silent)

    def receipt_on_end(self, receipt: Receipt[ToolCallInfo]) -> None:
        """Have the call's end complete ``receipt``: the idempotent command that decides the end (a result reported
        by a webhook backend) is answered by the end's own commit."""
        self._call.receipt_on_end(receipt)

    async def wait_for_playout(self) -> None:
        """Wait for the speech that produced this call to finish playing its text (the tool's preamble).

        Raises ``SpeechInterrupted`` promptly if that speech is interrupted.
        """
        await self._call.wait_for_playout()

    async def wait_if_not_cancelled(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` unless the call is cancelled first, in which case ``ToolCancelled`` is raised."""
        finished, result = await first_of(aw, self._call.cancel_fut)
        if not finished:
            raise ToolCancelled(self.call_id)
        return typing.cast(T, result)

    async def sleep(self, seconds: float) -> None:
        """``asyncio.sleep`` that ends early with ``ToolCancelled`` if the call is cancelled."""
        await self.wait_if_not_cancelled(asyncio.sleep(seconds))
