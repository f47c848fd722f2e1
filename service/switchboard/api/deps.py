"""What routes depend on: the service's parts (typed, set once at start), sessions by id, deadlines, read models."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends
from starlette.requests import HTTPConnection

from ..control.host import SessionHost, SessionView
from ..control.hub import EventHub
from ..control.metrics import Metrics
from ..control.settings import Settings
from ..integrations.webhooks import Webhooks
from ..runtime.session import AgentSession
from ..runtime.status import SessionStatus
from ..runtime.tools import ToolCallInfo
from ..store import Store
from .problems import ProblemError, not_found
from .schemas import SessionRead, ToolCallRead
from .stream_slots import StreamSlots


@dataclass(frozen=True, slots=True)
class Services:
    """The parts of a running service, built once by the app's lifespan (``app.state.services``)."""

    settings: Settings
    store: Store
    hub: EventHub
    host: SessionHost
    webhooks: Webhooks
    metrics: Metrics
    streams: StreamSlots


def services(conn: HTTPConnection) -> Services:
    found = conn.app.state.services
    if not isinstance(found, Services):  # pragma: no cover - the lifespan sets it before any request is served
        raise RuntimeError("the service is not started")
    return found


def _settings(conn: HTTPConnection) -> Settings:
    return services(conn).settings


def _host(conn: HTTPConnection) -> SessionHost:
    return services(conn).host


ServicesDep = Annotated[Services, Depends(services)]
SettingsDep = Annotated[Settings, Depends(_settings)]
HostDep = Annotated[SessionHost, Depends(_host)]


async def known_session(host: SessionHost, sid: str) -> SessionView:
    """The session, live or stored; 404 when it never existed."""
    view = await host.find(sid)
    if view is None:
        raise not_found("session", sid)
    return view


async def active_session(host: SessionHost, sid: str) -> AgentSession:
    """The live session, ready for commands; 409 when it exists but is not active, 404 when it never existed."""
    view = await known_session(host, sid)
    if view.live is None or view.state != SessionStatus.ACTIVE:
        raise ProblemError(409, "session_not_active", f"Session {sid!r} is {view.state}.")
    return view.live


async def _known_session(sid: str, host: HostDep) -> SessionView:
    return await known_session(host, sid)


KnownSession = Annotated[SessionView, Depends(_known_session)]


# Set while an idempotent command with a key runs: the request's deadline (``limits.RequestDeadline``) answers the
# caller, and the command runs on past it so that its real outcome is recorded under the key (see ``idempotency``).
command_outlives_caller: contextvars.ContextVar[bool] = contextvars.ContextVar("command_outlives_caller", default=False)


@contextlib.asynccontextmanager
async def deadline(settings: Settings) -> AsyncIterator[None]:
    """Bound a request's wait on the runtime/store: 503 with Retry-After instead of hanging (not for a command run
    under an Idempotency-Key: cutting it off would lose the answer its retry must get)."""
    try:
        if command_outlives_caller.get():
            yield
        else:
            async with asyncio.timeout(settings.request_timeout_s):
                yield
    except TimeoutError:
        raise ProblemError(
            503, "unavailable", "The service could not complete this in time; retry.", headers={"Retry-After": "1"}
        ) from None


def session_read(view: SessionView) -> SessionRead:
    rec, live = view.record, view.live
    if live is not None:
        return SessionRead(
            id=live.id,
            agent=live.agent.name,
            state=live.state,
            agent_state=live.agent_state,
            current_speech_id=live.current_speech.id if live.current_speech else None,
            created_at=rec.created_at,
            metadata=rec.metadata,
        )
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
