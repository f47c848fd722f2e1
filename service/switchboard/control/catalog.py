"""The agents a service offers, described for discovery (``GET /v1/agents``): names, tools and models, no secrets.

An agent is described from an instance its factory builds (once, then kept): the tools an agent has are what its
instances have. A webhook tool is described like any other (its endpoint and secret are not part of a tool).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, Field

from ..integrations.model_profiles import ModelProfiles
from ..runtime.agent import Agent, AgentRegistry
from ..runtime.llm import STAND_IN_PROVIDER
from ..runtime.tools import FunctionTool, ToolPolicy

logger = logging.getLogger("switchboard.control.catalog")


class ModelSummary(BaseModel):
    """A model by name: the provider, the provider's model name, the server's profile. Never a URL or a key."""

    provider: str = Field(
        description=f"`scripted`, `openai`, or `{STAND_IN_PROVIDER}` when nothing names a model: it calls the tools a "
        'user writes as calls, `search_tables(city="Rome")`, and says how to connect a model otherwise.'
    )
    model: str | None = Field(default=None, description="The provider's model name (none for a script).")
    profile: str | None = Field(default=None, description="The server's model profile, when one is used.")
    fallbacks: list[str] = Field(default_factory=list, description="The profiles tried, in order, when it fails.")


class ToolDescription(BaseModel):
    name: str
    description: str
    parameters: dict[str, Any] = Field(description="The JSON schema of the arguments.")
    policy: ToolPolicy


class AgentDescription(BaseModel):
    name: str
    description: str | None = Field(description="The agent class's docstring (its first paragraph), if any.")
    tools: list[ToolDescription]
    model: ModelSummary | None = Field(description="The model a session of this agent uses when it names none.")
    error: str | None = Field(default=None, description="Set when the agent cannot be built (its factory failed).")


def summarize_model(
    models: ModelProfiles, requested: Mapping[str, Any] | None, default: Mapping[str, Any] | None
) -> ModelSummary | None:
    """The model a session with ``llm=requested`` of an agent with ``default`` uses, by name only."""
    try:
        resolved = models.for_session(requested, default)
    except ValueError:
        return None
    if resolved is None:
        return ModelSummary(provider=STAND_IN_PROVIDER)
    profile = (requested if requested is not None else default or {}).get("profile")
    profile = profile if isinstance(profile, str) else None
    if resolved.get("provider") == "fallback":
        resolved = resolved["models"][0]
    model = resolved.get("model")
    return ModelSummary(
        provider=str(resolved.get("provider", "scripted")),
        model=model if isinstance(model, str) else None,
        profile=profile,
        fallbacks=models.fallbacks(profile) if profile else [],
    )


def _doc(agent: Agent) -> str | None:
    """The first paragraph of the agent class's own docstring: never one it inherits (an agent with none was
    described by the framework's "Subclass and declare tools as methods...")."""
    own = type(agent).__doc__
    if not own or type(agent) is Agent:
        return None
    return inspect.cleandoc(own).split("\n\n", 1)[0].replace("\n", " ").strip() or None


def _tool(tool: FunctionTool) -> ToolDescription:
    return ToolDescription(name=tool.name, description=tool.description, parameters=tool.parameters, policy=tool.policy)


class AgentCatalog:
    """Describes the registry's agents; each description is built on first use and kept."""

    def __init__(
        self, registry: AgentRegistry, models: ModelProfiles, default_llms: Mapping[str, Mapping[str, Any]]
    ) -> None:
        self.registry = registry
        self.models = models
        self.default_llms = default_llms
        self._described: dict[str, AgentDescription] = {}

    async def describe(self, name: str) -> AgentDescription:
        """The agent's description. One that takes tools from MCP servers is described anew each time, its servers
        listed first (cached by them, each listing bounded by its timeout): its tools are what the servers have."""
        found = self._described.get(name)
        if found is None:
            found, lists_servers = await self._build(name)
            if not lists_servers:
                self._described[name] = found
        return found

    async def all(self) -> list[AgentDescription]:
        """Every agent, described at once: agents whose MCP servers do not answer wait for them together."""
        return list(await asyncio.gather(*(self.describe(name) for name in self.registry.names())))

    async def _build(self, name: str) -> tuple[AgentDescription, bool]:
        model = summarize_model(self.models, None, self.default_llms.get(name))
        try:
            agent = self.registry.create(name)
        except Exception as err:  # an agent's own factory: report it, do not fail the listing
            logger.exception("agent %r cannot be built", name)
            return AgentDescription(name=name, description=None, tools=[], model=model, error=type(err).__name__), False
        await agent.load_tools()
        tools = sorted(agent.tools.values(), key=lambda t: t.name)
        described = AgentDescription(name=name, description=_doc(agent), tools=[_tool(t) for t in tools], model=model)
        return described, bool(agent.mcp_servers)
