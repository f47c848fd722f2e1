"""Agents: instructions plus tools, defined in Python and registered by name."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .tools import FunctionTool


class Agent:
    """Subclass and declare tools as methods decorated with ``@function_tool``.

    >>> class Concierge(Agent):
    ...     def __init__(self) -> None:
    ...         super().__init__(instructions="You book tables.")
    """

    def __init__(
        self,
        *,
        instructions: str,
        tools: Iterable[FunctionTool] = (),
        name: str | None = None,
    ) -> None:
        self.instructions = instructions
        self.name = name or getattr(type(self), "registry_name", None) or type(self).__name__.lower()
        self._extra_tools = list(tools)

    def __repr__(self) -> str:
        return f"<Agent {self.name}>"

    @property
    def tools(self) -> dict[str, FunctionTool]:
        found: dict[str, FunctionTool] = {}
        for klass in reversed(type(self).__mro__):
            for attr, value in vars(klass).items():
                if isinstance(value, FunctionTool):
                    bound = getattr(self, attr)
                    found[bound.name] = bound
        for tool in self._extra_tools:
            found[tool.name] = tool
        return found


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
