"""A typed Python client of the Switchboard API: :class:`Client` (blocking) and :class:`AsyncClient` (asyncio).

One method per operation, answers as typed models, problem+json answers as typed errors, commands idempotent
across retries, and event streams that resume from the last ``seq`` (or ``cursor``) across disconnects and restarts.
It needs only httpx, websockets and pydantic: nothing of the server is imported.
"""

from ._http import RetryPolicy, new_idempotency_key
from .aio import AsyncClient
from .errors import (
    BadRequest,
    Conflict,
    Forbidden,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    ServerError,
    SwitchboardError,
    TooManyRequests,
    Unauthorized,
    Unavailable,
    ValidationFailed,
)
from .events import AsyncEventStream, EventStream, Resume, ResumeHook
from .media import MediaConnection, MediaFrame
from .models import (
    AgentHandoff,
    AgentInfo,
    AttentionReason,
    ChatItem,
    ChatMessage,
    Event,
    FunctionCall,
    FunctionCallOutput,
    Health,
    InputAccepted,
    InterruptResult,
    OtherChatItem,
    SayAccepted,
    Session,
    SessionExport,
    SessionList,
    SessionToken,
    Speech,
    ToolCall,
    ToolProgress,
    ToolReport,
    ToolStatus,
    Usage,
)
from .sync import Client

__all__ = [
    "AgentHandoff",
    "AgentInfo",
    "AsyncClient",
    "AsyncEventStream",
    "AttentionReason",
    "BadRequest",
    "ChatItem",
    "ChatMessage",
    "Client",
    "Conflict",
    "Event",
    "EventStream",
    "Forbidden",
    "FunctionCall",
    "FunctionCallOutput",
    "Health",
    "InputAccepted",
    "InterruptResult",
    "MediaConnection",
    "MediaFrame",
    "NotFound",
    "OtherChatItem",
    "PayloadTooLarge",
    "RequestTimeout",
    "Resume",
    "ResumeHook",
    "RetryPolicy",
    "SayAccepted",
    "ServerError",
    "Session",
    "SessionExport",
    "SessionList",
    "SessionToken",
    "Speech",
    "SwitchboardError",
    "TooManyRequests",
    "ToolCall",
    "ToolProgress",
    "ToolReport",
    "ToolStatus",
    "Unauthorized",
    "Unavailable",
    "Usage",
    "ValidationFailed",
    "new_idempotency_key",
]
