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


class SessionSuspended(Exception):
    """The session is being handed over to another process (a drain, a graceful restart, a lost lease): it carries
    on there, so a command for it is to be retried. Never a kind of ``SessionClosed``: a session being moved has not
    ended, and whatever treats "closed" as final (a media edge that stops for good) must not see it as such."""


LIVE_STATUSES = frozenset({SessionStatus.INITIALIZING, SessionStatus.ACTIVE, SessionStatus.CLOSING})
ENDED_STATUSES = frozenset({SessionStatus.CLOSED, SessionStatus.FAILED})

__all__ = ["ENDED_STATUSES", "LIVE_STATUSES", "AgentState", "SessionClosed", "SessionStatus", "SessionSuspended"]
