"""Agents: instructions plus tools, defined in Python and registered by name."""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .chat import ChatItem, ChatMessage, new_id
from .tools import FunctionTool, StopResponse

logger = logging.getLogger("switchboard.runtime.agent")

# commands wait for the hook (it runs before the input is committed): one that hangs must not make the session deaf
USER_TURN_HOOK_TIMEOUT_S = 5.0
_WARNED_COLLISIONS: set[tuple[str, str, str]] = set()  # (agent, tool, server): each is logged once


class AgentSessionControl(Protocol):
    """What an agent's hooks may do with the session it is the agent of (``AgentSession`` implements it)."""

    async def say(self, text: str, *, allow_interruptions: bool = True, add_to_chat: bool = True) -> Any: ...

    async def generate_reply(self, *, instructions: str | None = None) -> Any: ...

    async def interrupt(self, *, force: bool = False) -> Any: ...


class ToolSource(Protocol):
    """Tools that live elsewhere (an MCP server): listed asynchronously, then read as last listed."""

    name: str

    async def refresh(self) -> None:
        """List the tools again unless the list is fresh; never raises (a failure keeps the last list)."""
        ...

    def tools(self) -> Sequence[FunctionTool]: ...


_TOOL_ATTRIBUTES: dict[type[Any], tuple[str, ...]] = {}


def _tool_attributes(cls: type[Any]) -> tuple[str, ...]:
    """The attributes of ``cls`` and its bases (bases first) that are function tools: found once per class (recovery
    reads the tools of every session's agent)."""
    found = _TOOL_ATTRIBUTES.get(cls)
    if found is None:
        attributes = ((attr, value) for klass in reversed(cls.__mro__) for attr, value in vars(klass).items())
        found = _TOOL_ATTRIBUTES[cls] = tuple(attr for attr, value in attributes if isinstance(value, FunctionTool))
    return found


class TurnContext:
    """The chat as the reply to a user turn will see it (``items``, without the new message). Messages added with
    ``add_message`` are shown to the model for this reply only, after the chat and before the new message; they
    are never persisted (to keep something, say it or let a tool return it)."""

    def __init__(self, items: Iterable[ChatItem]) -> None:
        self.items: tuple[ChatItem, ...] = tuple(items)
        self.added: list[ChatMessage] = []

    def add_message(self, *, role: str = "system", text: str) -> ChatMessage:
        message = ChatMessage(id=new_id("item"), role=role, text=text)
        self.added.append(message)
        return message


@dataclass
class NewMessage:
    """The user's message of a completed turn, as it is about to be committed: edit ``text`` to change it."""

    text: str
    role: str = "user"


@dataclass
class UserTurn:
    """What ``on_user_turn_completed`` made of a user turn: the text to commit, the messages shown to the model
    for this reply only, and whether a reply is wanted."""

    text: str
    extra: list[ChatMessage] = field(default_factory=list)
    reply: bool = True


class Agent:
    """Subclass and declare tools as methods decorated with ``@function_tool``.

    >>> class Concierge(Agent):
    ...     def __init__(self) -> None:
    ...         super().__init__(instructions="You book tables.", on_model_error="Sorry, one moment please.")
    ...     async def on_enter(self) -> None:
    ...         await self.session.say("Welcome to the concierge.")

    The hooks (``on_enter``, ``on_exit``, ``on_user_turn_completed``) do nothing unless overridden.
    ``on_model_error``: what the agent says when its model fails (after any fallback models), so that the caller
    hears something rather than silence; None says nothing. ``mcp_servers``: servers whose tools are the agent's
    tools too (``switchboard.integrations.mcp_tools``); a name the agent already has keeps its own tool.
    """

    def __init__(
        self,
        *,
        instructions: str,
        tools: Iterable[FunctionTool] = (),
        name: str | None = None,
        on_model_error: str | None = None,
        mcp_servers: Iterable[ToolSource] = (),
    ) -> None:
        self.instructions = instructions
        self.on_model_error = on_model_error
        self.name = name or getattr(type(self), "registry_name", None) or type(self).__name__.lower()
        self._extra_tools = list(tools)
        self.mcp_servers = list(mcp_servers)
        self._session: AgentSessionControl | None = None

    def __repr__(self) -> str:
        return f"<Agent {self.name}>"

    @property
    def session(self) -> AgentSessionControl:
        """The session this agent is the agent of (set when it becomes the session's agent)."""
        if self._session is None:
            raise RuntimeError(f"agent {self.name} is not running in a session")
        return self._session

    def attach(self, session: AgentSessionControl | None) -> None:
        """Called by the session when the agent becomes (or stops being) its agent."""
        self._session = session

    # -- hooks ------------------------------------------------------------------------------------------------

    async def on_enter(self) -> None:
        """Called once the agent has become the session's agent: when a new session starts (not when one is
        recovered after a restart), and after a handoff to it. Speak from here (``self.session.say(...)``,
        ``self.session.generate_reply(...)``); it runs in a task of its own, the session does not wait for it."""

    async def on_exit(self) -> None:
        """Called when a handoff moves the session to another agent, just before the switch (not waited for)."""

    async def on_user_turn_completed(self, turn_ctx: TurnContext, new_message: NewMessage) -> None:
        """Called for each final user input that asks for a reply, before it is committed and the reply queued.

        Edit ``new_message.text`` to change what is committed; add messages to ``turn_ctx`` for this reply only;
        raise ``StopResponse`` to commit the message without a reply. An error is logged and the input is handled
        unchanged (input is never dropped)."""

    @property
    def tools(self) -> dict[str, FunctionTool]:
        found: dict[str, FunctionTool] = {}
        for attr in _tool_attributes(type(self)):
            bound = getattr(self, attr)
            found[bound.name] = bound
        for tool in self._extra_tools:
            found[tool.name] = tool
        for server in self.mcp_servers:
            for tool in server.tools():
                found.setdefault(tool.name, tool)
        return found

    async def load_tools(self) -> None:
        """List the tools of the agent's MCP servers (each bounded by its timeout, cached by the server); a tool
        whose name the agent already has is left out, with a warning. The session calls it before the agent's tools
        are shown to the model: when it starts or recovers, and when a handoff makes this agent its agent."""
        if not self.mcp_servers:
            return
        await asyncio.gather(*(server.refresh() for server in self.mcp_servers))
        owners: dict[str, str] = {name: "the agent" for name in self._own_tool_names()}
        for server in self.mcp_servers:
            for tool in server.tools():
                key = (self.name, tool.name, server.name)
                if tool.name in owners and key not in _WARNED_COLLISIONS:
                    _WARNED_COLLISIONS.add(key)
                    logger.warning(
                        "agent %s: tool %r of MCP server %s is left out: %s has a tool of that name",
                        self.name,
                        tool.name,
                        server.name,
                        owners[tool.name],
                    )
                owners.setdefault(tool.name, f"MCP server {server.name}")

    def _own_tool_names(self) -> set[str]:
        names = {t.name for t in self._extra_tools}
        for klass in type(self).__mro__:
            names.update(v.name for v in vars(klass).values() if isinstance(v, FunctionTool))
        return names


async def complete_user_turn(
    agent: Agent,
    items: Iterable[ChatItem],
    text: str,
    *,
    session_id: str,
    timeout_s: float = USER_TURN_HOOK_TIMEOUT_S,
) -> UserTurn:
    """Run the agent's ``on_user_turn_completed`` on a final user ``text``. A hook that fails or takes longer than
    ``timeout_s`` leaves the turn as it was (logged): the input is still committed and answered."""
    turn_ctx = TurnContext(items)
    message = NewMessage(text)
    try:
        async with asyncio.timeout(timeout_s):
            await agent.on_user_turn_completed(turn_ctx, message)
    except StopResponse:
        return UserTurn(message.text, [], reply=False)
    except TimeoutError:
        logger.error(
            "on_user_turn_completed of agent %s took longer than %.1fs; the turn is handled unchanged",
            agent.name,
            timeout_s,
            extra={"session_id": session_id},
        )
        return UserTurn(text)
    except Exception:
        logger.exception(
            "on_user_turn_completed of agent %s failed; the turn is handled unchanged",
            agent.name,
            extra={"session_id": session_id},
        )
        return UserTurn(text)
    if not isinstance(message.text, str) or not message.text.strip():
        logger.error("on_user_turn_completed of agent %s left an empty message; kept the original", agent.name)
        return UserTurn(text, list(turn_ctx.added))
    return UserTurn(message.text, list(turn_ctx.added))


AgentFactory = Callable[[], Agent]


class UnknownAgent(LookupError):
    pass


class AgentsImportError(ImportError):
    """An agents spec (``module:ATTR``) names a module that cannot be found, or an attribute it lacks."""


class AgentRegistry:
    """Agent name -> zero-argument factory."""

    def __init__(self, agents: Mapping[str, AgentFactory] | None = None) -> None:
        self._factories: dict[str, AgentFactory] = {}
        for name, factory in (agents or {}).items():
            self.register(name, factory)

    def register(self, name: str, factory: AgentFactory) -> None:
        self._factories[name] = factory
        if isinstance(factory, type) and issubclass(factory, Agent) and "registry_name" not in vars(factory):
            factory.registry_name = name  # type: ignore[attr-defined]

    def names(self) -> list[str]:
        return sorted(self._factories)

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def create(self, name: str) -> Agent:
        try:
            factory = self._factories[name]
        except KeyError:
            raise UnknownAgent(f"unknown agent {name!r} (registered: {', '.join(self.names())})") from None
        agent = factory()
        agent.name = name
        return agent

    @classmethod
    def load(cls, spec: str | None, *, builtin: Mapping[str, AgentFactory] | None = None) -> AgentRegistry:
        """Load ``"pkg.module:AGENTS[,other.module:AGENTS]"`` on top of the built-in agents."""
        registry = cls(builtin)
        for part in (spec or "").split(","):
            part = part.strip()
            if not part:
                continue
            module_name, _, attr = part.partition(":")
            attr = attr or "AGENTS"
            module = _import(module_name, part)
            agents = getattr(module, attr, None)
            if agents is None:
                raise AgentsImportError(f"{part}: module {module_name!r} has no attribute {attr!r}")
            if not isinstance(agents, Mapping):
                raise TypeError(f"{part} is not a mapping of agent names to factories")
            for name, factory in agents.items():
                registry.register(name, factory)
        return registry


def _import(module_name: str, part: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not module_name.startswith(err.name):
            raise  # the module exists but imports something missing: its own traceback says what
        raise AgentsImportError(
            f"{part}: no module named {module_name!r} (looked in the working directory and on the Python path)"
        ) from None
