"""What routes depend on: the service's parts (typed, set once at start), sessions by id, deadlines, read models."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from dataclasses import dataclass
from types import TracebackType
from typing import Annotated

import httpx
from fastapi import Depends
from starlette.requests import HTTPConnection

from ..control.cluster.fanout import RedisFanout
from ..control.cluster.routing import Elsewhere, Retry, Unavailable, locate
from ..control.host import SessionHost
from ..control.hub import EventHub
from ..control.metrics import Metrics
from ..control.session_view import SessionView
from ..control.settings import Settings
from ..integrations.webhooks import Webhooks
from ..runtime.session import AgentSession
from ..runtime.status import SessionStatus
from ..runtime.tools import ToolCallInfo
from ..store import NodeState, Store
from .cluster.forward import FORWARDED_HEADER, SessionElsewhere
from .media.budget import TranscriptBudget
from .problems import ProblemError, not_found
from .rate_limit import RateLimiter
from .schemas import LatencyRead, SessionRead, TakeoverRead, ToolCallRead
from .sessions.export_budget import ExportBudget
from .streams.stream_slots import StreamSlots

_RETRY = {"Retry-After": "1"}


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
    writes: RateLimiter  # commands
    reads: RateLimiter
    exports: ExportBudget
    transcripts: TranscriptBudget  # what media edges may store (``media.budget``)
    forwarder: httpx.AsyncClient  # commands for sessions other nodes run (``cluster.forward``)
    fanout: RedisFanout | None = None  # cluster mode: events to and from the other nodes


def services(conn: HTTPConnection) -> Services:
    found = conn.app.state.services
    if not isinstance(found, Services):  # pragma: no cover - the lifespan sets it before any request is served
        raise RuntimeError("the service is not started")
    return found


# Dependencies are coroutines: FastAPI runs a plain function in its thread pool, a thread hop per dependency and
# request that costs more than the lookup itself once the event loop is busy (see ``tests/api/test_dependencies.py``).
async def _services(conn: HTTPConnection) -> Services:
    return services(conn)


async def _settings(conn: HTTPConnection) -> Settings:
    return services(conn).settings


async def _host(conn: HTTPConnection) -> SessionHost:
    return services(conn).host


ServicesDep = Annotated[Services, Depends(_services)]
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
    await owned_here(host, view)
    if view.live is not None and view.live.state == SessionStatus.INITIALIZING:  # being recovered (or started) here
        detail = f"Session {sid!r} is being recovered; retry."
        raise ProblemError(503, Retry.RECOVERING.value, detail, headers=_RETRY)
    # a session being handed over (a drain) still takes input and speeches durably, for its next owner; other
    # commands answer 503 session_moving (``SessionSuspended``)
    if view.live is None or view.state not in (SessionStatus.ACTIVE, SessionStatus.SUSPENDED):
        raise ProblemError(409, "session_not_active", f"Session {sid!r} is {view.state}.")
    return view.live


async def owned_here(host: SessionHost, view: SessionView) -> None:
    """A command for a live session this node does not run answers 503 (retry): it is moving or being recovered, or
    another node runs it. In cluster mode the routing seam (``cluster.routing.OwnerRouting``) sent such a request to the
    owner before any route ran; one that reaches a route anyway was forwarded here by a node that saw this one as
    the owner (and is never forwarded twice), or this instance was replaced (a single node)."""
    where = await locate(host, view.id, view.record)
    if isinstance(where, Unavailable):
        raise ProblemError(503, where.retry.value, where.detail, headers=_RETRY)
    if isinstance(where, Elsewhere):
        detail = f"Session {view.id!r} is run by node {where.node_id}, not this one; retry."
        raise ProblemError(503, Retry.MOVED.value, detail, headers=_RETRY)


def is_forwarded(conn: HTTPConnection) -> bool:
    """Another node forwarded this request here (its header checked by ``ForwardedGuard``)."""
    return FORWARDED_HEADER in conn.headers


async def _forwarded(conn: HTTPConnection) -> bool:
    return is_forwarded(conn)


Forwarded = Annotated[bool, Depends(_forwarded)]


async def place_new_session(host: SessionHost, forwarded: bool) -> None:
    """Cluster mode: a new session goes to the least-loaded live node (this one on a tie); a request another node
    forwarded here is placed here."""
    if not host.settings.cluster_mode or forwarded:
        return
    # holding a lease on the database's clock (which judges leases), not on this node's
    live = [n for n in await host.store.nodes.list_nodes(states=[NodeState.LIVE]) if n.leased]
    mine = next((n.sessions for n in live if n.id == host.node_id), 0)
    draining = host.lease is not None and host.lease.draining
    if draining:  # this node takes no new session: any other live node does
        live = [n for n in live if n.id != host.node_id]
    target = min(live, key=lambda n: (n.sessions, n.id != host.node_id), default=None)
    if target is not None and target.id != host.node_id and (draining or target.sessions < mine):
        raise SessionElsewhere("(new)", target.id, target.url)


async def _known_session(sid: str, host: HostDep) -> SessionView:
    return await known_session(host, sid)


KnownSession = Annotated[SessionView, Depends(_known_session)]


# Set while an idempotent command with a key runs: the request's deadline (``limits.RequestDeadline``) answers the
# caller, and the command runs on past it so that its real outcome is recorded under the key (see ``idempotency``).
command_outlives_caller: contextvars.ContextVar[bool] = contextvars.ContextVar("command_outlives_caller", default=False)


class _Deadline:
    """``deadline``: a class rather than a generator, for it runs on every command (a generator-based context manager
    costs a command several calls more)."""

    __slots__ = ("_timeout",)

    def __init__(self, settings: Settings) -> None:
        self._timeout = None if command_outlives_caller.get() else asyncio.timeout(settings.request_timeout_s)

    async def __aenter__(self) -> None:
        if self._timeout is not None:
            await self._timeout.__aenter__()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self._timeout is not None:
                await self._timeout.__aexit__(exc_type, exc, tb)  # raises TimeoutError when it cut the body off
        except TimeoutError:
            raise _unavailable() from None
        if exc_type is not None and issubclass(exc_type, TimeoutError):
            raise _unavailable() from None


def _unavailable() -> ProblemError:
    return ProblemError(
        503, "unavailable", "The service could not complete this in time; retry.", headers={"Retry-After": "1"}
    )


def deadline(settings: Settings) -> contextlib.AbstractAsyncContextManager[None]:
    """Bound a request's wait on the runtime/store: 503 with Retry-After instead of hanging (not for a command run
    under an Idempotency-Key: cutting it off would lose the answer its retry must get)."""
    return _Deadline(settings)


def _ms(seconds: float | None) -> float | None:
    return round(seconds * 1000, 1) if seconds is not None else None


def _latency(host: SessionHost, view: SessionView) -> LatencyRead:
    ttft = getattr(view.live.llm, "last_ttft_s", None) if view.live is not None else None
    return LatencyRead(
        time_to_first_token_ms=_ms(ttft if isinstance(ttft, float) else None),
        time_to_first_audio_ms=_ms(host.attention.first_audio_s(view.id)),
    )


def _takeover(view: SessionView) -> TakeoverRead | None:
    """Who holds the session: as it runs here (with the holder's last sign), else as stored."""
    live = view.live
    hold = live.seat.hold if live is not None else view.record.takeover
    if hold is None or (live is None and not SessionStatus(view.record.state).live):
        return None
    seen = live.seat.last_seen if live is not None else None
    return TakeoverRead(operator=hold.operator, since=hold.since, displaced=hold.displaced, last_seen_at=seen)


# what a session live in the database but served nowhere at this instant reads as: one this node claimed and is
# recovering is being started (as it is once in memory, ``initializing``); one being handed over, or whose owner is
# gone, is suspended until a node takes it up. Never ``active``: that read promises that a command is applied now
_NOT_SERVED_STATE = {
    Retry.RECOVERING: SessionStatus.INITIALIZING,
    Retry.MOVING: SessionStatus.SUSPENDED,
    Retry.MOVED: SessionStatus.SUSPENDED,
}


async def session_read_now(view: SessionView, host: SessionHost) -> SessionRead:
    """``session_read`` for one session, told as a command would find it now: a session live in the database that
    no node serves at this instant (moving, being recovered) does not read ``active`` (the database's word), but as
    ``_NOT_SERVED_STATE`` says, so a client that waits for ``active`` before it sends a command gets no 503."""
    if view.live is not None or not SessionStatus(view.record.state).live:
        return session_read(view, host)
    where = await locate(host, view.id, view.record)
    return session_read(view, host, not_served=where.retry if isinstance(where, Unavailable) else None)


def session_read(view: SessionView, host: SessionHost, not_served: Retry | None = None) -> SessionRead:
    rec, live = view.record, view.live
    common = {
        "created_at": rec.created_at,
        "metadata": rec.metadata,
        "last_activity_at": host.attention.last_activity(rec.id) or rec.updated_at,
        "attention": [r.model_dump() for r in host.attention_reasons(view)],
        "model": host.model_summary(rec),
        "latency": _latency(host, view),
        "takeover": _takeover(view),
    }
    if live is not None:
        return SessionRead(
            id=live.id,
            agent=live.agent.name,
            state=live.state,
            agent_state=live.agent_state,
            current_speech_id=live.current_speech.id if live.current_speech else None,
            owner_node=rec.owner_node,
            **common,
        )
    recovering = not_served == Retry.RECOVERING
    return SessionRead(
        id=rec.id,
        agent=rec.agent,
        state=_NOT_SERVED_STATE[not_served] if not_served is not None else rec.state,
        agent_state="initializing" if recovering else "listening",
        current_speech_id=None,
        owner_node=rec.owner_node if SessionStatus(rec.state).live else None,
        **common,
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
        error=info.error,
        speech_id=info.speech_id,
        started_at=info.started_at,
        ended_at=info.ended_at,
    )
