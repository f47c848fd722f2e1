"""Configuration from the environment (prefix ``SWITCHBOARD_``)."""

from __future__ import annotations

import ipaddress
import secrets
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

Scope = Literal["sessions:read", "sessions:write", "sessions:control", "tools:cancel", "tools:report", "events:read"]
ALL_SCOPES: tuple[Scope, ...] = (
    "sessions:read",
    "sessions:write",
    "sessions:control",
    "tools:cancel",
    "tools:report",
    "events:read",
)


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
    token_secret: str = Field(default_factory=lambda: secrets.token_urlsafe(32))
    token_ttl_s: int = Field(default=3600, ge=10, le=7 * 24 * 3600)

    max_body_bytes: int = Field(default=64 * 1024, ge=1024)
    body_read_timeout_s: float = Field(default=10.0, gt=0)  # a body chunk must arrive within this (408)
    body_timeout_s: float = Field(default=30.0, gt=0)  # and the whole body within this (408)
    max_text_chars: int = Field(default=8000, ge=1)
    max_sessions: int = Field(default=1000, ge=1)
    ws_buffer: int = Field(default=1000, ge=10)
    ws_ping_interval_s: float = Field(default=20.0, gt=0)
    ws_max_message_bytes: int = Field(default=64 * 1024, ge=1024)  # a bigger client frame is closed with 1009
    request_timeout_s: float = Field(default=10.0, gt=0)
    idempotency_ttl_s: int = Field(default=24 * 3600, ge=24 * 3600)
    words_per_second: float = Field(default=3.0, gt=0)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _empty_keys(cls, value: object) -> object:
        return [] if value in ("", None) else value

    @field_validator("models", mode="before")
    @classmethod
    def _empty_models(cls, value: object) -> object:
        return {} if value in ("", None) else value

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    def check_bind(self, host: str | None = None) -> None:
        """With no API keys, refuse to listen anywhere but loopback."""
        host = host or self.host
        if self.auth_enabled:
            return
        if host in ("localhost", ""):
            return
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(
                f"refusing to bind {host!r} with authentication off: set SWITCHBOARD_API_KEYS or bind 127.0.0.1"
            )
