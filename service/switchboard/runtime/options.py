"""SessionOptions: how one session behaves (its limits, timeouts and interruption policy)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from .speech import INTERRUPT_FORCE_TIMEOUT_S
from .user_turn import CLOSE_TRANSCRIPT_TIMEOUT_S


class SessionOptions(BaseModel):
    """How one session behaves; the server sets the tool call limits, a session's config the rest."""

    max_tool_steps: int = Field(default=3, ge=0, le=20)
    # set by the server, never by a session: calls of one model turn past it end in an error without running
    max_tool_calls_per_turn: int = Field(default=16, ge=1)
    # and the calls of the whole session past this one (restarts included) end `rejected` without running
    max_tool_calls_per_session: int = Field(default=1000, ge=1)
    # Keep the ids a model gives its calls. Off (the default), the session names every call itself: a model or a
    # script never picks the id that backends, reports and the API use, and ids never collide across sessions. On
    # only for tests whose scripts name their calls.
    trust_model_call_ids: bool = False
    preemptive_generation: bool = False
    allow_interruptions: bool = True
    interrupt_force_timeout_s: float = Field(default=INTERRUPT_FORCE_TIMEOUT_S, gt=0)
    tool_cancel_grace_s: float = Field(default=1.0, ge=0)
    close_timeout_s: float = Field(default=30.0, gt=0)
    # a close that finds the user talking waits this long at most for the final transcript (recorded, not answered)
    close_transcript_timeout_s: float = Field(default=CLOSE_TRANSCRIPT_TIMEOUT_S, ge=0)
    # at shutdown, how long calls that cannot be cancelled get to end on their own before they are abandoned
    shutdown_tool_grace_s: float = Field(default=10.0, ge=0)
    # an agent's on_user_turn_completed past this is abandoned and the turn handled unchanged (input is never dropped)
    user_turn_hook_timeout_s: float = Field(default=5.0, gt=0)


__all__ = ["SessionOptions"]
