"""Configuration from the environment (prefix ``SWITCHBOARD_``)."""

from __future__ import annotations

import ipaddress
import json
import secrets
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

Scope = Literal[
    "sessions:read", "sessions:write", "sessions:control", "tools:cancel", "tools:report", "events:read", "metrics:read"
]
ALL_SCOPES: tuple[Scope, ...] = (
    "sessions:read",
    "sessions:write",
    "sessions:control",
    "tools:cancel",
    "tools:report",
    "events:read",
    "metrics:read",
)
# a comma-separated list in the environment ("a,b"), or a JSON list
CommaList = Annotated[list[str], NoDecode]


class ApiKey(BaseModel):
    key: str = Field(min_length=16)
    scopes: list[Scope]
    name: str | None = None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SWITCHBOARD_", env_file=None, extra="ignore")

    database_url: str = "sqlite+aiosqlite:///./var/switchboard.db"
    agents: str | None = None
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
    ws_buffer: int = Field(default=1000, ge=10)
    ws_ping_interval_s: float = Field(default=20.0, gt=0)
    # open event streams (each costs memory and a file descriptor): more are closed at once with 4429
    ws_max_streams: int = Field(default=1000, ge=1)
    ws_max_streams_per_credential: int = Field(default=100, ge=1)
    ws_max_message_bytes: int = Field(default=64 * 1024, ge=1024)  # a bigger client frame is closed with 1009
    request_timeout_s: float = Field(default=10.0, gt=0)
    idempotency_ttl_s: int = Field(default=24 * 3600, ge=24 * 3600)
    words_per_second: float = Field(default=3.0, gt=0)

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

    @field_validator("models", mode="before")
    @classmethod
    def _empty_models(cls, value: object) -> object:
        return {} if value in ("", None) else value

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

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
