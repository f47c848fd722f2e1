"""What a session is created from: its ``SessionConfig``, stored with it and read back on recovery."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from ..runtime.options import SessionOptions
from ..store import SessionRecord
from .settings import Settings


class PlayoutSettings(BaseModel):
    """How a session's simulated playout speaks; what is not given is the service's setting."""

    model_config = ConfigDict(frozen=True)

    words_per_second: float | None = None
    first_audio_ms: int | None = None


class SessionConfig(BaseModel):
    """How a session runs, as it was created; stored as the session's ``config`` (JSON) and read back on recovery.

    ``agent`` is the agent the session started with (a handoff changes the running agent, not this).
    ``llm`` is opaque here: the provider that ``build_llm`` picks validates it.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str | None = None
    agent: str
    llm: dict[str, Any] | None = None
    playout: PlayoutSettings | None = None
    preemptive_generation: bool | None = None
    allow_interruptions: bool | None = None
    max_tool_steps: int | None = None
    # who created it (a digest of the API key; None with auth off): its live sessions count against that key's quota
    owner: str | None = None

    @classmethod
    def from_record(cls, rec: SessionRecord) -> SessionConfig:
        """The configuration of a stored session (rows written without an ``agent`` in it run ``rec.agent``)."""
        return cls.model_validate({"agent": rec.agent, **rec.config, "id": rec.id})

    def stored(self) -> dict[str, Any]:
        """The JSON kept in the session row: only what was given, so equal bodies give equal rows."""
        return self.model_dump(mode="json", exclude_none=True)

    def options(self) -> SessionOptions:
        given = {
            "max_tool_steps": self.max_tool_steps,
            "preemptive_generation": self.preemptive_generation,
            "allow_interruptions": self.allow_interruptions,
        }
        return SessionOptions(**{key: value for key, value in given.items() if value is not None})


class SharedOptions:
    """The options of a session of a config, with the server's limits: one object per distinct set, shared by the
    sessions that have it (none changes its options), not one object per session."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._made: dict[tuple[int | None, bool | None, bool | None], SessionOptions] = {}

    def __call__(self, config: SessionConfig) -> SessionOptions:
        key = (config.max_tool_steps, config.preemptive_generation, config.allow_interruptions)
        found = self._made.get(key)
        if found is None:
            found = self._made[key] = config.options().model_copy(
                update={
                    "max_tool_calls_per_turn": self._settings.max_tool_calls_per_turn,
                    "max_tool_calls_per_session": self._settings.max_tool_calls_per_session,
                    "shutdown_tool_grace_s": self._settings.shutdown_tool_grace_s,
                }
            )
        return found


__all__ = ["PlayoutSettings", "SessionConfig", "SharedOptions"]
