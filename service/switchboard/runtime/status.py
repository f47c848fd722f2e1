"""The lifecycle status of a session, shared by the runtime, the store and the API (its values are on the wire)."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

# What the agent is doing, reported as ``agent.state`` events (the values are on the wire).
AgentState = Literal["initializing", "listening", "thinking", "speaking"]


class SessionStatus(StrEnum):
    """``initializing`` (created, not started) -> ``active`` -> ``closing`` -> ``closed``.

    ``suspended``: stopped by a service shutdown, recovered on the next start. ``failed``: could not be recovered.
    """

    INITIALIZING = "initializing"
    ACTIVE = "active"
    SUSPENDED = "suspended"
    CLOSING = "closing"
    CLOSED = "closed"
    FAILED = "failed"

    @property
    def live(self) -> bool:
        """Live in the store: a restart resumes it."""
        return self in LIVE_STATUSES

    @property
    def ended(self) -> bool:
        """Over for good: nothing follows."""
        return self in ENDED_STATUSES


class SessionClosed(Exception):
    """The session is not active (closing, closed or not started): a command for it is refused."""


class SessionSuspended(SessionClosed):
    """The session is suspended here (its process is stopping, or another one took it over): it carries on
    elsewhere, so a command for it is to be retried."""


LIVE_STATUSES = frozenset({SessionStatus.INITIALIZING, SessionStatus.ACTIVE, SessionStatus.CLOSING})
ENDED_STATUSES = frozenset({SessionStatus.CLOSED, SessionStatus.FAILED})

__all__ = ["ENDED_STATUSES", "LIVE_STATUSES", "AgentState", "SessionClosed", "SessionStatus", "SessionSuspended"]
