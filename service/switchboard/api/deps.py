"""Shared helpers for routers: the host, the live session or its stored record, timeouts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import Request

from ..host import SessionHost
from ..runtime.session import AgentSession
from ..runtime.status import SessionStatus
from ..runtime.tools import ToolCallInfo
from ..settings import Settings
from ..store import SessionRecord, Store
from .problems import ProblemError, not_found
from .schemas import SessionRead, ToolCallRead


def host(request: Request) -> SessionHost:
    return request.app.state.host  # type: ignore[no-any-return]


def store(request: Request) -> Store:
    return request.app.state.store  # type: ignore[no-any-return]


def settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


async def known_session(request: Request, sid: str) -> AgentSession | None:
    """The live session, or None when the session exists only in the store (closed, failed); 404 when neither.

    Only a session that is not live costs a store read.
    """
    session = host(request).live(sid)
    if session is None and await store(request).get_session(sid) is None:
        raise not_found("session", sid)
    return session


async def live_or_409(request: Request, sid: str) -> AgentSession:
    """The live session; 409 when it exists but is closed, 404 when it never existed."""
    session = host(request).live(sid)
    if session is not None and session.state == SessionStatus.ACTIVE:
        return session
    rec = await store(request).get_session(sid)
    if rec is None and session is None:
        raise not_found("session", sid)
    state = session.state if session is not None else rec.state if rec else "unknown"
    raise ProblemError(409, "session_not_active", f"Session {sid!r} is {state}.")


@contextlib.asynccontextmanager
async def deadline(request: Request) -> AsyncIterator[None]:
    """Bound a request's wait on the runtime/store: 503 with Retry-After instead of hanging."""
    try:
        async with asyncio.timeout(settings(request).request_timeout_s):
            yield
    except TimeoutError:
        raise ProblemError(
            503, "unavailable", "The service could not complete this in time; retry.", headers={"Retry-After": "1"}
        ) from None


def session_read(rec: SessionRecord | None, live: AgentSession | None) -> SessionRead:
    if live is not None:
        assert rec is not None
        return SessionRead(
            id=live.id,
            agent=live.agent.name,
            state=live.state,
            agent_state=live.agent_state,
            current_speech_id=live.current_speech.id if live.current_speech else None,
            created_at=rec.created_at,
            metadata=rec.metadata,
        )
    assert rec is not None
    return SessionRead(
        id=rec.id,
        agent=rec.agent,
        state=rec.state,
        agent_state="listening",
        current_speech_id=None,
        created_at=rec.created_at,
        metadata=rec.metadata,
    )


def tool_call_read(sid: str, info: ToolCallInfo) -> ToolCallRead:
    return ToolCallRead(
        session_id=sid,
        call_id=info.call_id,
        name=info.name,
        arguments=info.arguments,
        status=info.status.value,
        cancellable=info.cancellable,
        scope=info.scope,
        background=info.background,
        progress=[p.model_dump() for p in info.progress],
        output=info.output,
        is_error=info.is_error,
        speech_id=info.speech_id,
        started_at=info.started_at,
        ended_at=info.ended_at,
    )
