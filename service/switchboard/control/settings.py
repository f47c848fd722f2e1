"""Configuration from the environment (prefix ``SWITCHBOARD_``)."""

from __future__ import annotations

import ipaddress
import json
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from ..integrations.signing import MAKE_STANDARD_SECRET, STANDARD_SECRET_PREFIX, signing_key

Scope = Literal[
    "sessions:read",
    "sessions:write",
    "sessions:control",
    "tools:cancel",
    "tools:report",
    "events:read",
    "metrics:read",
    "media:connect",
]
ALL_SCOPES: tuple[Scope, ...] = get_args(Scope)
SINGLE_LEASE_S = 10.0
CLUSTER_LEASE_S = 2.0
# a comma-separated list in the environment ("a,b"), or a JSON list
CommaList = Annotated[list[str], NoDecode]


class ApiKey(BaseModel):
    key: str = Field(min_length=16)
    scopes: list[Scope]
    name: str | None = None


class AlertSink(BaseModel):
    """A webhook that receives alerts (``SWITCHBOARD_ALERT_SINKS``, see docs/alerts.md): the reasons and the agents it
    subscribes to (unset: every one), where it is, and the Standard Webhooks secret its deliveries are signed with."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)  # a bad entry is refused unquoted: its secret

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    url: str
    secret: str = Field(repr=False)
    reasons: list[str] | None = None  # attention reason codes (any code, a future one too); None: every reason
    agents: list[str] | None = None  # agent names; None: every agent
    timeout_s: float = Field(default=5.0, gt=0, le=60)  # one attempt's bound

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("an alert sink's url must be an http:// or https:// URL with a host")
        return value

    @field_validator("secret")
    @classmethod
    def _standard_secret(cls, value: str) -> str:
        if not value.startswith(STANDARD_SECRET_PREFIX):
            raise ValueError(f"an alert sink's secret must be a Standard Webhooks secret ({MAKE_STANDARD_SECRET})")
        signing_key(value)  # ValueError: says what is wrong, never quoting it
        return value

    def subscribes(self, reason: str, agents: Iterable[str]) -> bool:
        """The sink wants an alert of ``reason`` for a session running (or started with) one of ``agents``."""
        if self.reasons is not None and reason not in self.reasons:
            return False
        return self.agents is None or any(agent in self.agents for agent in agents)


class Settings(BaseSettings):
    # hide_input_in_errors: a refused setting is named, never quoted (it may hold a key or a secret)
    model_config = SettingsConfigDict(
        env_prefix="SWITCHBOARD_", env_file=None, extra="ignore", hide_input_in_errors=True
    )

    database_url: str = "sqlite+aiosqlite:///./var/switchboard.db"
    agents: str | None = None
    demo_agents: bool = True  # the built-in "demo" and "billing" agents (false: only the agents you configure)
    agents_file: Path | None = None  # YAML or JSON agents with webhook tools (see agents_file.py)
    # named model profiles (name -> provider config): the only way a session reaches a model server
    models: dict[str, dict[str, Any]] = Field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    log_level: str = "INFO"
    log_json: bool = False
    migrate_on_start: bool = True

    api_keys: list[ApiKey] = Field(default_factory=list)
    # a short secret can be brute-forced offline from any token it signed
    token_secret: str = Field(default_factory=lambda: secrets.token_urlsafe(32), min_length=32)
    token_ttl_s: int = Field(default=3600, ge=10, le=7 * 24 * 3600)

    max_body_bytes: int = Field(default=64 * 1024, ge=1024)
    body_read_timeout_s: float = Field(default=10.0, gt=0)  # a body chunk must arrive within this (408)
    body_timeout_s: float = Field(default=30.0, gt=0)  # and the whole body within this (408)
    max_text_chars: int = Field(default=8000, ge=1)
    max_sessions: int = Field(default=1000, ge=1)
    # live sessions one API key may run at once (unset: half of max_sessions), so no key can fill the server
    max_sessions_per_key: int | None = Field(default=None, ge=1)
    # a live session with nothing happening (no input, speech or tool call) for this long is closed, reason "idle"
    # (0: never)
    idle_timeout_s: float = Field(default=3600.0, ge=0)
    # closed and failed sessions are deleted from the store (chat, tool calls, events) this long after they ended
    # (0: kept forever)
    closed_retention_s: float = Field(default=7 * 24 * 3600.0, ge=0)
    housekeeping_interval_s: float = Field(default=30.0, gt=0)  # how often the two above are applied
    ws_buffer: int = Field(default=1000, ge=10)
    ws_ping_interval_s: float = Field(default=20.0, gt=0)
    # open event streams (each costs memory and a file descriptor): more are closed at once with 4429
    ws_max_streams: int = Field(default=1000, ge=1)
    ws_max_streams_per_credential: int = Field(default=100, ge=1)
    # of ws_max_streams, the last this many are kept for operators (keys holding sessions:control): readers together
    # never take them (unset: a tenth of ws_max_streams)
    ws_operator_reserve: int | None = Field(default=None, ge=0)
    ws_max_message_bytes: int = Field(default=64 * 1024, ge=1024)  # a bigger client frame is closed with 1009
    request_timeout_s: float = Field(default=10.0, gt=0)
    # The network edge (api/connections.py): a connection whose request line and headers have not all arrived this
    # long after it opened (or after the first byte of a later request on it) is answered 408 and closed
    header_timeout_s: float = Field(default=5.0, gt=0)
    # connections open at once from one client address (an IPv6 client: its /64); one more is answered 429 and
    # closed (0: no cap). Behind a proxy every connection comes from the proxy's address: see docs/security.md.
    # Unset: 256 alone, none in cluster mode (the nodes relay media edges to each other, each node from one address,
    # and sit behind a balancer that limits clients)
    max_connections_per_client: int | None = Field(default=None, ge=0)
    # connections whose request headers have not all arrived, in the process; past it the longest waiting are
    # answered 503 and closed, so slow or idle clients never hold the descriptors served clients need (0: no cap)
    max_pending_connections: int = Field(default=256, ge=0)
    # a media edge (WS /v1/sessions/{sid}/media) sending more frames than this per second (over a burst of twice
    # as many) is closed with 4429
    media_max_frames_per_s: float = Field(default=100.0, gt=0)
    # the user's transcripts one caller's media edges may have stored, all its edges and sessions together, in
    # characters per second (a transcript counts at least 100), over a burst of twice as many (0: no limit); over it an
    # interim transcript is coalesced, a final one refused with when to send it again (docs/media-edge.md)
    media_transcript_chars_per_s: float = Field(default=20_000.0, ge=0)
    idempotency_ttl_s: int = Field(default=24 * 3600, ge=24 * 3600)
    # commands (POST, DELETE) per API key: a bucket of write_burst refilled at write_rate_per_s (0: no limit); one
    # more is a 429 with Retry-After. With auth off nothing is limited.
    write_rate_per_s: float = Field(default=20.0, ge=0)
    write_burst: int = Field(default=100, ge=1)
    # reads (GET on /v1) per API key, a session token's spent from its minter's: a bucket of read_burst refilled at
    # read_rate_per_s (0: no limit), far above what consoles polling their panels ask; one more is a 429.
    read_rate_per_s: float = Field(default=50.0, ge=0)
    read_burst: int = Field(default=300, ge=1)
    # session exports (GET /v1/sessions/{sid}/export) running at once in one process, and of one API key (its
    # tokens included); one more is a 429. With auth off only the process's cap holds.
    export_max: int = Field(default=8, ge=1)
    export_max_per_key: int = Field(default=2, ge=1)
    # the bytes a second one API key's exports send together (0: no limit): an export waits for its budget
    export_bytes_per_s: int = Field(default=8 * 1024 * 1024, ge=0)
    words_per_second: float = Field(default=3.0, gt=0)
    # the simulated voice's time to first audio (a session's playout.first_audio_ms overrides it)
    first_audio_ms: int = Field(default=0, ge=0, le=10_000)
    # when a session enters the attention queue (GET /v1/sessions?attention=true, the console's queue)
    attention_long_tool_s: float = Field(default=60.0, gt=0)  # a tool call running this long
    attention_stall_s: float = Field(default=10.0, gt=0)  # a generation with nothing to play this long
    attention_silence_s: float = Field(default=8.0, gt=0)  # a reply to input not yet heard this long
    # an operator holding a session (a takeover) with no say nor heartbeat this long
    attention_operator_quiet_s: float = Field(default=60.0, gt=0)
    # Alerts (docs/alerts.md): the webhooks that receive each session's reasons for attention, as a JSON list of
    # {name, url, secret, reasons?, agents?, timeout_s?}; the same on every node of a cluster
    alert_sinks: Annotated[list[AlertSink], NoDecode] = Field(default_factory=list)
    alert_interval_s: float = Field(default=2.0, gt=0, le=60)  # how often the sessions' reasons are compared
    alert_max_attempts: int = Field(default=8, ge=1, le=50)  # a delivery is given up after this many attempts
    alert_backoff_s: float = Field(default=1.0, gt=0)  # the wait after a first failed attempt, doubled each time
    alert_backoff_max_s: float = Field(default=60.0, gt=0)  # and capped at this
    alert_queue_max: int = Field(default=1000, ge=1)  # deliveries waiting per sink; more drop the oldest

    # Browsers (see docs/security.md). With auth off only loopback Host and Origin headers are accepted; these add
    # host names (no port) and exact origins ("https://ops.example.com") for a trusted proxy or dashboard.
    allowed_hosts: CommaList = Field(default_factory=list)
    allowed_origins: CommaList = Field(default_factory=list)
    public_docs: bool = True  # /docs, /redoc, /openapi.json without a credential when auth is on
    public_metrics: bool = False  # /metrics without a credential (else it needs the metrics:read scope)
    # A session's own scripted model picks its tool calls and their arguments: with auth on only when allowed
    scripted_model: Literal["allow", "deny"] | None = None
    max_webhook_response_bytes: int = Field(default=1024 * 1024, ge=1024)  # a bigger answer fails the tool call
    max_tool_calls_per_turn: int = Field(default=16, ge=1)  # further calls of one model turn are refused, not run
    max_tool_calls_per_session: int = Field(default=1000, ge=1)  # and further calls of one session (restarts too)

    # Nodes and ownership (see docs/cluster.md). Cluster mode: ``redis_url`` set, on PostgreSQL.
    redis_url: str | None = None
    # Cluster mode: how long a command waits for the cluster's rate-limit bucket in Redis before it charges its node's
    # own instead (a command is never held up by Redis for longer)
    rate_limit_redis_timeout_s: float = Field(default=0.05, gt=0, le=10)
    node_id: str | None = Field(default=None, min_length=1, max_length=100, pattern=r"^[A-Za-z0-9._:-]+$")
    advertise_url: str | None = None  # how the other nodes reach this one (default: http://host:port)
    cluster_secret: str | None = Field(default=None, min_length=32)  # authenticates node-to-node calls
    # How long a node's lease lasts without renewal (default: 10 s alone, 2 s in a cluster, where it bounds failover)
    lease_s: float | None = Field(default=None, ge=0.5, le=300)
    # Alone on a database: how long a new instance waits for a live one to stop before it refuses to start
    takeover_wait_s: float = Field(default=15.0, ge=0)
    # How long a start waits for its database while it is unavailable (refused, reset, locked) before it gives up
    database_wait_s: float = Field(default=30.0, ge=0)
    # Cluster mode, on SIGTERM: how long a node spends handing its sessions over before it stops anyway
    drain_timeout_s: float = Field(default=20.0, ge=0, le=600)
    # When a session is handed over (a drain, a graceful restart): how long a tool call that cannot be cancelled gets
    # to end and commit its result here before it is left to the next owner (which ends it or runs it again)
    shutdown_tool_grace_s: float = Field(default=10.0, ge=0, le=600)
    # PostgreSQL: the bound of every statement (the server's statement_timeout; the client gives up 1 s later) and of
    # the wait for a pooled connection; opening one is bounded by min(5 s, this). A hang is an outage, not a wait.
    database_timeout_s: float = Field(default=10.0, gt=0, le=600)

    @model_validator(mode="before")
    @classmethod
    def _empty_secrets_unset(cls, data: Any) -> Any:
        """A secret set to nothing (``VAR=``, as a compose file's ``${VAR:-}`` gives) is a secret not set."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (k in ("token_secret", "cluster_secret") and v == "")}
        return data

    @field_validator("api_keys", mode="before")
    @classmethod
    def _empty_keys(cls, value: object) -> object:
        return [] if value in ("", None) else value

    @field_validator("allowed_hosts", "allowed_origins", mode="before")
    @classmethod
    def _comma_list(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [part.strip() for part in text.split(",") if part.strip()]
        return value

    @field_validator("allowed_hosts", mode="after")
    @classmethod
    def _hosts_lower(cls, value: list[str]) -> list[str]:
        return [host.lower().rstrip(".") for host in value]

    @field_validator("allowed_origins", mode="after")
    @classmethod
    def _origins_lower(cls, value: list[str]) -> list[str]:
        return [origin.lower().rstrip("/") for origin in value]

    @field_validator("alert_sinks", mode="before")
    @classmethod
    def _sinks_json(cls, value: object) -> object:
        """A JSON list in the environment; set to nothing (a compose file's ``${VAR:-}``): no sink."""
        if isinstance(value, str):
            try:
                return json.loads(value) if value.strip() else []
            except json.JSONDecodeError as err:  # said without quoting what was given (it holds secrets)
                raise ValueError(f"not JSON ({err.msg} at character {err.pos})") from None
        return [] if value is None else value

    @field_validator("alert_sinks", mode="after")
    @classmethod
    def _unique_sinks(cls, value: list[AlertSink]) -> list[AlertSink]:
        names = [sink.name for sink in value]
        if len(set(names)) != len(names):
            raise ValueError("alert sinks need distinct names")
        return value

    @field_validator("models", mode="before")
    @classmethod
    def _empty_models(cls, value: object) -> object:
        return {} if value in ("", None) else value

    @property
    def cluster_mode(self) -> bool:
        return bool(self.redis_url)

    @property
    def effective_lease_s(self) -> float:
        if self.lease_s is not None:
            return self.lease_s
        return CLUSTER_LEASE_S if self.cluster_mode else SINGLE_LEASE_S

    def check_cluster(self) -> None:
        """Cluster mode needs PostgreSQL, a token secret shared by every node (a session token or a report credential
        minted on one node is checked by whichever node a load balancer picks), and a secret for node-to-node calls
        unless every address is loopback and auth is off. With API keys, a forwarded call skips the rate limits it was
        charged where it arrived, so a key holder on the same machine must not be able to claim one: without a secret
        the claim is a known word."""
        if not self.cluster_mode:
            return
        if not self.database_url.startswith(("postgresql", "postgres")):
            raise ValueError("cluster mode (SWITCHBOARD_REDIS_URL) needs a PostgreSQL SWITCHBOARD_DATABASE_URL")
        if "token_secret" not in self.model_fields_set:  # unset, it is random per process: each node's own
            raise ValueError("cluster mode needs SWITCHBOARD_TOKEN_SECRET (32+ chars), the same on every node")
        if self.cluster_secret is None and self.auth_enabled:
            raise ValueError("cluster mode with SWITCHBOARD_API_KEYS needs SWITCHBOARD_CLUSTER_SECRET (32+ chars)")
        advertised = urlsplit(self.advertise_url).hostname if self.advertise_url else self.host
        if self.cluster_secret is None and not (is_loopback_name(self.host) and is_loopback_name(advertised or "")):
            raise ValueError("cluster mode on a non-loopback address needs SWITCHBOARD_CLUSTER_SECRET (32+ chars)")

    def secret_values(self) -> list[str]:
        """The secrets these settings hold (API keys, the token and cluster secrets): kept out of every log line."""
        sinks = (sink.secret for sink in self.alert_sinks)
        return [*(api_key.key for api_key in self.api_keys), self.token_secret, self.cluster_secret or "", *sinks]

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    @model_validator(mode="after")
    def _reserve_below_cap(self) -> Settings:
        if self.ws_operator_reserve is not None and self.ws_operator_reserve >= self.ws_max_streams:
            raise ValueError(
                f"SWITCHBOARD_WS_OPERATOR_RESERVE ({self.ws_operator_reserve}) must be below "
                f"SWITCHBOARD_WS_MAX_STREAMS ({self.ws_max_streams})"
            )
        return self

    @property
    def connections_per_client(self) -> int:
        """The cap on one client address's connections (0: none)."""
        if self.max_connections_per_client is not None:
            return self.max_connections_per_client
        return 0 if self.redis_url else 256

    @property
    def operator_stream_reserve(self) -> int:
        """Stream slots only operators may take."""
        if self.ws_operator_reserve is not None:
            return self.ws_operator_reserve
        return self.ws_max_streams // 10

    @property
    def session_quota(self) -> int:
        """Live sessions one API key may run at once."""
        if self.max_sessions_per_key is not None:
            return self.max_sessions_per_key
        return max(1, self.max_sessions // 2)

    @property
    def sessions_may_script(self) -> bool:
        """Auth off (local development, tests): allowed unless denied; auth on: only when allowed."""
        if self.scripted_model is None:
            return not self.auth_enabled
        return self.scripted_model == "allow"

    def check_bind(self, host: str | None = None) -> None:
        """With no API keys, refuse to listen anywhere but loopback ("" and 0.0.0.0 / :: are every interface)."""
        host = self.host if host is None else host
        if self.auth_enabled:
            return
        if not is_loopback_name(host):
            raise ValueError(
                f"refusing to bind {host!r} with authentication off: set SWITCHBOARD_API_KEYS or bind 127.0.0.1"
            )


def is_loopback_name(host: str) -> bool:
    """``localhost``, or an address in 127.0.0.0/8 or ::1 (brackets allowed). Not "", not 0.0.0.0 or ::."""
    host = host.strip().lower().rstrip(".")
    if host == "localhost":
        return True
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
