"""Declarative agents: a YAML or JSON file (``SWITCHBOARD_AGENTS_FILE``) of agents whose tools are webhooks.

The file holds a list of agents, or a mapping of agent names to agents::

    - name: concierge
      instructions: You book tables.
      greeting: Welcome to the concierge. How can I help?   # optional: said when the agent enters
      llm: {provider: openai, model: gpt-4o-mini}      # optional: used when a session gives no llm
      tools:
        - kind: webhook
          name: search_tables
          description: Search free tables.
          parameters: {type: object, properties: {city: {type: string}}, required: [city]}
          url: https://backend.example/tools/search_tables
          secret_env: CONCIERGE_WEBHOOK_SECRET

An agent may also take the tools of MCP servers (``mcp_servers:``, see ``mcp_tools``)::

      mcp_servers:
        - name: crm
          url: https://crm.example/mcp         # or, for a local server: command: [crm-mcp, --stdio]
          headers_env: {Authorization: CRM_MCP_AUTHORIZATION}   # header -> environment variable holding it
          tools: [find_customer, open_ticket]   # optional allow-list
          timeout_s: 20
          policies: {open_ticket: {on_duplicate: reject, timeout_s: 60}}

It is validated completely at startup; every problem is reported with the file and the field
(``agents.yaml: agents[0].tools[0].url: ...``) and the service does not start.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    HttpUrl,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..runtime.agent import Agent, AgentFactory, AgentRegistry
from ..runtime.executor import COMPANION_TOOLS
from ..runtime.llm import MissingCredential, build_llm
from ..runtime.tools import CONFIRM_FIELD, OnRestart, ToolPolicy
from .mcp_tools import (
    DEFAULT_TOOLS_TTL_S,
    LIST_TIMEOUT_S,
    MIN_TOOLS_TTL_S,
    MCPServer,
    MCPServerHTTP,
    MCPServerStdio,
    MCPToolPolicy,
)
from .model_profiles import SESSION_TUNABLE
from .schema_model import SchemaError, object_model
from .signing import STANDARD_SECRET_PREFIX, Signature, signing_key
from .webhooks import WebhookEndpoint, Webhooks, WebhookTool, default_cancel_url

logger = logging.getLogger("switchboard.integrations.agents_file")

AGENT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}$"
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # what model providers accept as a function name
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
MAX_TIMEOUT_S = 24 * 3600.0
# a webhook secret keys the HMAC-SHA256 of every call (signing.sign): a short one can be guessed offline from one
# signed delivery, so it needs as many characters as a 32-byte random key has (secrets.token_urlsafe(32): 43); a
# whsec_ secret needs the key length Standard Webhooks asks for instead (signing.signing_key)
MIN_SECRET_CHARS = 32


class AgentsFileError(ValueError):
    """The agents file cannot be used; the message names the file and each bad field."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WebhookToolSpec(ToolPolicy):
    """A webhook tool: where its calls go, what they take, and the policy fields of ``ToolPolicy`` beside them (a
    webhook call goes on where its session runs next unless ``on_restart`` says otherwise)."""

    on_restart: OnRestart = "resume"
    kind: Literal["webhook"]
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    url: HttpUrl
    cancel_url: HttpUrl | None = None
    timeout_s: float = Field(default=30.0, gt=0, le=MAX_TIMEOUT_S)
    secret_env: str = Field(pattern=ENV_NAME_PATTERN)
    # None: Standard Webhooks alone for a whsec_ secret, both schemes for any other (signing.default_signature)
    signature: Signature | None = None

    @property
    def policy(self) -> ToolPolicy:
        return ToolPolicy(**self.model_dump(include=set(ToolPolicy.model_fields)))

    @field_validator("name")
    @classmethod
    def _not_companion(cls, value: str) -> str:
        if value in COMPANION_TOOLS:
            raise ValueError(f"{value!r} is a built-in tool name")
        return value

    @field_validator("parameters")
    @classmethod
    def _schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type", "object") != "object":
            raise ValueError("must be a JSON Schema of type 'object'")
        try:
            object_model(value, "", "arguments")
        except SchemaError as err:
            raise ValueError(f"unsupported JSON Schema: {err}") from None
        if CONFIRM_FIELD in value.get("properties", {}):
            raise ValueError(f"{CONFIRM_FIELD!r} is reserved (on_duplicate='confirm' adds it)")
        return value

    @field_validator("secret_env")
    @classmethod
    def _secret_set(cls, value: str, info: ValidationInfo) -> str:
        environ: Mapping[str, str] = (info.context or {}).get("environ", os.environ)
        secret = environ.get(value)
        if not secret:
            raise ValueError(f"environment variable {value} is not set (it holds the webhook signing secret)")
        try:
            signing_key(secret)
        except ValueError as err:
            raise ValueError(f"environment variable {value} holds {err}") from None
        if not secret.startswith(STANDARD_SECRET_PREFIX) and len(secret) < MIN_SECRET_CHARS:
            raise ValueError(
                f"environment variable {value} holds a webhook signing secret of {len(secret)} characters; at least "
                f"{MIN_SECRET_CHARS} are needed (make one with: "
                "python -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
        return value


class MCPServerSpec(_Spec):
    """An MCP server whose tools an agent takes: ``url`` (streamable HTTP) or ``command`` (a local server over stdio,
    run from the service's working directory). Credentials come from the environment: ``headers_env`` maps a header
    to the variable holding its value, ``env_from`` a variable of the server's process to one of this process."""

    name: str | None = Field(default=None, pattern=AGENT_NAME_PATTERN)
    url: HttpUrl | None = None
    command: list[str] | None = Field(default=None, min_length=1)
    headers_env: dict[str, str] = Field(default_factory=dict)
    env_from: dict[str, str] = Field(default_factory=dict)
    tools: list[str] | None = None
    prefix: str = Field(default="", pattern=r"^[A-Za-z0-9_-]{0,32}$")
    timeout_s: float = Field(default=30.0, gt=0, le=MAX_TIMEOUT_S)
    tools_ttl_s: float = Field(default=DEFAULT_TOOLS_TTL_S, ge=MIN_TOOLS_TTL_S)
    list_timeout_s: float = Field(default=LIST_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)
    policies: dict[str, MCPToolPolicy] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_transport(self) -> MCPServerSpec:
        if (self.url is None) == (self.command is None):
            raise ValueError("give either url (streamable HTTP) or command (stdio)")
        if self.url is not None and self.env_from:
            raise ValueError("env_from is for a command; a server at a url takes headers_env")
        if self.command is not None and self.headers_env:
            raise ValueError("headers_env is for a url; a command takes env_from")
        return self

    @field_validator("headers_env", "env_from")
    @classmethod
    def _variables_set(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        environ: Mapping[str, str] = (info.context or {}).get("environ", os.environ)
        for key, variable in value.items():
            if not re.fullmatch(ENV_NAME_PATTERN, variable):
                raise ValueError(f"{key}: {variable!r} is not an environment variable name")
            if not environ.get(variable):
                raise ValueError(f"{key}: environment variable {variable} is not set")
        return value

    def build(self, environ: Mapping[str, str]) -> MCPServer:
        common: dict[str, Any] = {
            "name": self.name,
            "timeout_s": self.timeout_s,
            "tools": self.tools,
            "policies": self.policies,
            "prefix": self.prefix,
            "tools_ttl_s": self.tools_ttl_s,
            "list_timeout_s": self.list_timeout_s,
        }
        if self.url is not None:
            headers = {header: environ[variable] for header, variable in self.headers_env.items()}
            return MCPServerHTTP(str(self.url), headers=headers, **common)
        assert self.command is not None
        env = {key: environ[variable] for key, variable in self.env_from.items()}
        return MCPServerStdio(self.command, env=env, **common)


class AgentSpec(_Spec):
    name: str = Field(pattern=AGENT_NAME_PATTERN)
    instructions: str = Field(min_length=1)
    # said as is when the agent enters: when a session starts with it, and after a handoff to it
    greeting: str | None = Field(default=None, min_length=1, max_length=2000)
    llm: dict[str, Any] | None = None
    on_model_error: str | None = Field(default=None, min_length=1, max_length=1000)
    tools: list[WebhookToolSpec] = Field(default_factory=list)
    mcp_servers: list[MCPServerSpec] = Field(default_factory=list)

    @field_validator("llm")
    @classmethod
    def _llm(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and "profile" in value:
            # a reference to a model profile of the server (checked against SWITCHBOARD_MODELS at startup)
            extra = sorted(set(value) - {"profile", *SESSION_TUNABLE})
            if extra or not isinstance(value["profile"], str):
                raise ValueError(f"a profile reference takes only 'profile' and {', '.join(sorted(SESSION_TUNABLE))}")
        elif value is not None:
            try:
                build_llm(value)  # providers build lazily: this checks the config, it opens nothing
            except MissingCredential as err:
                # the service starts; a session of this agent is refused, naming the variable
                logger.warning("an agent's model cannot be used: %s", err)
            except ValidationError as err:
                raise ValueError("invalid llm configuration: " + _join_errors(err)) from None
            except ValueError as err:
                raise ValueError(f"invalid llm configuration: {err}") from None
        return value

    @model_validator(mode="after")
    def _unique_tools(self) -> AgentSpec:
        if dups := _repeated(t.name for t in self.tools):
            raise ValueError(f"duplicate tool name(s): {', '.join(dups)}")
        return self


class AgentsFile(_Spec):
    agents: list[AgentSpec]

    @model_validator(mode="after")
    def _unique_agents(self) -> AgentsFile:
        if dups := _repeated(a.name for a in self.agents):
            raise ValueError(f"duplicate agent name(s): {', '.join(dups)}")
        return self


def _repeated(names: Iterable[str]) -> list[str]:
    """The names that occur more than once, sorted."""
    counts = Counter(names)
    return sorted(name for name, count in counts.items() if count > 1)


def _join_errors(err: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in err.errors())


def _location(loc: tuple[int | str, ...], keys: list[str] | None) -> str:
    """``("agents", 0, "tools", 1, "url")`` -> ``agents[0].tools[1].url`` (or ``concierge.tools[1].url``)."""
    out = ""
    parts = list(loc)
    if parts[:1] == ["agents"]:
        parts = parts[1:]
        if keys is not None and parts and isinstance(parts[0], int) and parts[0] < len(keys):
            out, parts = keys[parts[0]], parts[1:]
        else:
            out = "agents"
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or "agents"


def _message(error: Any) -> str:
    msg = str(error["msg"])
    return msg.removeprefix("Value error, ")


def read_agents_file(path: str | Path, *, environ: Mapping[str, str] | None = None) -> list[AgentSpec]:
    """Parse and validate the file. Raises ``AgentsFileError`` listing every problem with its location."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise AgentsFileError(f"{path}: cannot read the agents file ({err.strerror or err})") from None
    is_json = path.suffix.lower() == ".json"
    try:
        data = json.loads(text) if is_json else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as err:
        raise AgentsFileError(f"{path}: not valid {'JSON' if is_json else 'YAML'}: {err}") from None
    keys: list[str] | None = None
    if isinstance(data, dict):
        keys = [str(k) for k in data]
        entries: list[Any] = []
        for key, body in data.items():
            if isinstance(body, dict) and body.get("name", key) != key:
                raise AgentsFileError(f"{path}: {key}.name: differs from the agent's key {key!r}")
            entries.append({**body, "name": str(key)} if isinstance(body, dict) else body)
    elif isinstance(data, list):
        entries = data
    else:
        raise AgentsFileError(f"{path}: must hold a list of agents or a mapping of agent names to agents")
    try:
        parsed = AgentsFile.model_validate(
            {"agents": entries}, context={"environ": os.environ if environ is None else environ}
        )
    except ValidationError as err:
        problems = [f"  {_location(tuple(e['loc']), keys)}: {_message(e)}" for e in err.errors()]
        raise AgentsFileError(f"{path}: invalid agents file:\n" + "\n".join(problems)) from None
    return parsed.agents


class DeclaredAgent(Agent):
    """An agent of the agents file: its hooks are what the file declares (a greeting on enter)."""

    def __init__(
        self,
        *,
        name: str,
        instructions: str,
        tools: Iterable[WebhookTool],
        greeting: str | None = None,
        on_model_error: str | None = None,
        mcp_servers: Iterable[MCPServer] = (),
    ) -> None:
        super().__init__(
            instructions=instructions, tools=tools, name=name, on_model_error=on_model_error, mcp_servers=mcp_servers
        )
        self.greeting = greeting

    async def on_enter(self) -> None:
        if self.greeting:
            await self.session.say(self.greeting)


@dataclass(frozen=True)
class DeclaredAgents:
    """Agents from an agents file, ready to register: a factory each, and the llm configs they default to."""

    path: Path
    factories: dict[str, AgentFactory]
    default_llms: dict[str, dict[str, Any]]

    def register(self, registry: AgentRegistry) -> None:
        taken = sorted(name for name in self.factories if name in registry)
        if taken:
            raise AgentsFileError(
                f"{self.path}: agent name(s) already defined by a Python agent or the built-ins: {', '.join(taken)}"
            )
        for name, factory in self.factories.items():
            registry.register(name, factory)


def webhook_tool(spec: WebhookToolSpec, webhooks: Webhooks, secret: str) -> WebhookTool:
    url = str(spec.url)
    endpoint = WebhookEndpoint(
        url=url,
        cancel_url=str(spec.cancel_url) if spec.cancel_url else default_cancel_url(url),
        timeout_s=spec.timeout_s,
        secret=secret,
        signature=spec.signature,
    )
    return WebhookTool(
        name=spec.name,
        description=spec.description,
        parameters=spec.parameters,
        endpoint=endpoint,
        webhooks=webhooks,
        policy=spec.policy,
    )


def load_agents_file(
    path: str | Path, webhooks: Webhooks, *, environ: Mapping[str, str] | None = None
) -> DeclaredAgents:
    """Read the file and build its agents. Secrets are read from the environment once, here."""
    environ = os.environ if environ is None else environ
    specs = read_agents_file(path, environ=environ)
    factories: dict[str, AgentFactory] = {}
    for spec in specs:
        tools = tuple(webhook_tool(t, webhooks, environ[t.secret_env]) for t in spec.tools)
        # built once: every session of the agent shares each server's cached tool list
        servers = tuple(server.build(environ) for server in spec.mcp_servers)
        factories[spec.name] = functools.partial(
            DeclaredAgent,
            instructions=spec.instructions,
            tools=tools,
            name=spec.name,
            greeting=spec.greeting,
            on_model_error=spec.on_model_error,
            mcp_servers=servers,
        )
    llms = {spec.name: spec.llm for spec in specs if spec.llm is not None}
    return DeclaredAgents(Path(path), factories, llms)
