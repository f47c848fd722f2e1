"""Sessions: create, list, read, close; operator commands (input, say, interrupt); chat and speeches."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response

from ...control.session_view import SessionView
from ...control.settings import Settings
from ...runtime.session import InputResult
from ...runtime.speech import SpeechHandle
from ...runtime.status import SessionStatus
from ...store import InvalidCursor, SessionRecord
from .. import audit, deps
from ..auth import Require, issue_token, principal_of, seal_token, token_scopes, unseal_token
from ..cluster.attention import (
    ATTENTION_TIMEOUT_S,
    MISSING_NODES_DESCRIPTION,
    MISSING_NODES_HEADER,
    ClusterAttention,
    merged,
)
from ..deps import HostDep, KnownSession, ServicesDep, SettingsDep
from ..idempotency import Idem, idempotent, idempotent_sealed
from ..problems import POST_ERRORS, ProblemError, not_found, problem_responses
from ..schemas import (
    CHAT_PAGE_DEFAULT,
    CHAT_PAGE_MAX,
    MAX_SESSIONS_PAGE,
    ChatRead,
    InputAccepted,
    InputCreate,
    InterruptCreate,
    InterruptResult,
    SayAccepted,
    SayCreate,
    SessionCreate,
    SessionList,
    SessionRead,
    SessionStateFilter,
    SpeechRead,
    TokenCreate,
    TokenRead,
)
from ..schemas_scheduled import ScheduledRead
from .scheduled import schedule, scheduled_at

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])


def _check_text(settings: Settings, text: str) -> None:
    limit = settings.max_text_chars
    if len(text) > limit:
        raise ProblemError(413, "text_too_long", f"text is {len(text)} characters; the limit is {limit}.")


@router.post(
    "",
    operation_id="createSession",
    status_code=201,
    response_model=SessionRead,
    responses={
        200: {"model": SessionRead, "description": "Already exists with the same body"},
        **problem_responses(400, 408, (409, "Exists with a different body, or a reused Idempotency-Key"), 413, 429),
    },
    dependencies=[Depends(Require("sessions:write"))],
)
@idempotent
async def create_session(body: SessionCreate, request: Request, response: Response, idem: Idem) -> SessionRead:
    """Create a live session running `agent`. Creating the same `id` again with the same body returns it (200),
    also when the two creates reach two nodes at once; with a different body it is a conflict (409). In cluster mode
    it runs on the least-loaded node. One API key runs at most `SWITCHBOARD_MAX_SESSIONS_PER_KEY` live sessions, on
    all nodes together (429 `session_quota_exceeded`)."""
    # the service's parts from the request, not as dependencies: FastAPI solves each one on every request, and the
    # solving cost a create more than these lookups
    found = deps.services(request)
    host, settings = found.host, found.settings
    await deps.place_new_session(host, deps.is_forwarded(request))
    # the creator's live sessions count against its key's quota (with auth off there is one caller: no quota)
    owner = principal_of(request).identity if settings.auth_enabled else None
    config = body.session_config().model_copy(update={"owner": owner})

    def created_answer(rec: SessionRecord) -> SessionRead:  # the session as its insert creates it, started
        started = rec.model_copy(update={"state": SessionStatus.ACTIVE})
        return deps.session_read(SessionView(started, None, host.store), host)

    async with deps.deadline(settings):
        session, created = await host.create(config, body.metadata, receipt=idem.receipt(created_answer))
    if not created:
        response.status_code = 200
    return deps.session_read(session, host)


@router.get(
    "",
    operation_id="listSessions",
    response_model=SessionList,
    responses={
        200: {
            "description": "Successful Response",
            "headers": {MISSING_NODES_HEADER: {"description": MISSING_NODES_DESCRIPTION, "schema": {"type": "string"}}},
        }
    },
    dependencies=[Depends(Require("sessions:read"))],
)
async def list_sessions(
    services: ServicesDep,
    request: Request,
    response: Response,
    forwarded: deps.Forwarded,
    state: Annotated[SessionStateFilter | None, Query()] = None,
    agent: Annotated[str | None, Query(min_length=1, max_length=100, description="The agent it started with.")] = None,
    attention: Annotated[
        bool,
        Query(
            description="Only the sessions that need an operator (each with its `attention` reasons), the longest "
            "waiting first, in one page: the live sessions and those that failed since their node started. In "
            f"cluster mode, every node's (a node that does not answer within {ATTENTION_TIMEOUT_S:g} s is left out "
            "and named in "
            f"`{MISSING_NODES_HEADER}`)."
        ),
    ] = False,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_SESSIONS_PAGE)] = 50,
) -> SessionList:
    """List sessions, newest first, optionally by `state` (active, closed, failed) and `agent`; or, with
    `attention=true`, the sessions that need an operator (in cluster mode, on every node)."""
    host = services.host
    if attention:
        views = await host.needing_attention(agent=agent)
        items = [deps.session_read(view, host) for view in views]
        if services.settings.cluster_mode and not forwarded:  # forwarded: a node gathering the cluster's list
            cluster = ClusterAttention(services, request)
            items = merged(items, await cluster.others(agent))
            if cluster.missing:
                response.headers[MISSING_NODES_HEADER] = ",".join(cluster.missing)
        return SessionList(items=items[:limit], next_cursor=None)
    try:
        views, next_cursor = await host.list_sessions(state=state, agent=agent, cursor=cursor, limit=limit)
    except InvalidCursor:
        raise ProblemError(422, "invalid_cursor", "The cursor is not valid.") from None
    return SessionList(items=[deps.session_read(view, host) for view in views], next_cursor=next_cursor)


@router.get(
    "/{sid}",
    operation_id="getSession",
    responses=problem_responses(404),
    response_model=SessionRead,
    dependencies=[Depends(Require("sessions:read"))],
)
async def get_session(session: KnownSession, services: ServicesDep, request: Request) -> SessionRead | Response:
    """Read one session. In cluster mode a node that does not run it asks the node that does (its agent state and
    current speech are only there), or answers from the database when that node does not answer. A session that no
    node serves at this instant (it is moving, or being recovered) reads `suspended` or `initializing`, not `active`,
    until a command sent to it would be applied."""
    return await deps.session_read_now(session, services.host)


@router.delete(
    "/{sid}",
    operation_id="closeSession",
    responses=problem_responses(404),
    status_code=204,
    response_class=Response,
    dependencies=[Depends(Require("sessions:write"))],
)
async def close_session(session: KnownSession, host: HostDep, request: Request) -> Response:
    """Close a session: stop speaking, cancel cancellable tools, await the others, emit the final events."""
    await deps.owned_here(host, session)
    if session.live is not None:
        audit.record(request, session.live, "close")
        await host.close(session.id)
    return Response(status_code=204)


@router.get(
    "/{sid}/chat",
    operation_id="getChat",
    responses=problem_responses(404),
    response_model=ChatRead,
    dependencies=[Depends(Require("sessions:read"))],
)
async def get_chat(
    session: KnownSession,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=CHAT_PAGE_MAX)] = CHAT_PAGE_DEFAULT,
) -> ChatRead:
    """The session's chat context in conversation order (each tool output right after its call), a page at a time:
    `next_cursor` is where the next page starts (null on the last). The cursor names the last item returned, so a
    page never repeats an item; an output that arrives later for a call on an earlier page appears on that page when
    it is read again."""
    try:
        page, more = await session.chat_page(cursor, limit)
    except KeyError:
        raise ProblemError(422, "invalid_cursor", "The cursor is not an item of this chat.") from None
    return ChatRead(items=page, next_cursor=page[-1].id if more and page else None)


def _accepted(result: InputResult) -> InputAccepted:
    return InputAccepted(item_id=result.item_id, speech_id=result.speech_id)


@router.post(
    "/{sid}/input",
    operation_id="injectInput",
    responses=problem_responses(*POST_ERRORS),
    status_code=202,
    response_model=InputAccepted,
    dependencies=[Depends(Require("sessions:control"))],
)
@idempotent
async def inject_input(
    sid: str, body: InputCreate, host: HostDep, settings: SettingsDep, request: Request, idem: Idem
) -> InputAccepted:
    """Inject user input. `final=false` is an interim transcript (reported, not committed). A final input
    interrupts the current speech when `interrupt` is true and it allows it (or `force`), and queues a reply.
    With `when`, it is scheduled instead (`scheduled`), and applied as it would be now when its point comes."""
    _check_text(settings, body.text)
    session = await deps.active_session(host, sid)
    if scheduled_at(body.when):
        args = body.model_dump(include={"text", "interrupt", "force", "reply", "role"})
        async with deps.deadline(settings):
            scheduled = await schedule(request, host.store, session, "input", args, body.when, idem, _input_scheduled)
        return _input_scheduled(scheduled)
    async with deps.deadline(settings):
        result = await session.input(
            body.text,
            final=body.final,
            interrupt=body.interrupt,
            force=body.force,
            reply=body.reply,
            role=body.role,
            receipt=idem.receipt(_accepted),
        )
    if body.final:  # an interim transcript changes nothing: not an action worth a line in the trail
        audit.record(
            request, session, "input", item_id=result.item_id, speech_id=result.speech_id, force=body.force or None
        )
    return _accepted(result)


def _input_scheduled(scheduled: ScheduledRead) -> InputAccepted:
    return InputAccepted(item_id=None, speech_id=None, scheduled=scheduled)


def _said(speech: SpeechHandle) -> SayAccepted:
    return SayAccepted(speech_id=speech.id)


def _say_scheduled(scheduled: ScheduledRead) -> SayAccepted:
    return SayAccepted(speech_id=None, scheduled=scheduled)


@router.post(
    "/{sid}/say",
    operation_id="say",
    responses=problem_responses(*POST_ERRORS),
    status_code=202,
    response_model=SayAccepted,
    dependencies=[Depends(Require("sessions:control"))],
)
@idempotent
async def say(
    sid: str, body: SayCreate, host: HostDep, settings: SettingsDep, request: Request, idem: Idem
) -> SayAccepted:
    """Have the agent say `text` verbatim, after anything already queued; with `when`, at that point of the
    conversation instead (`scheduled`): a backend can make the agent speak at the right moment without cutting it
    off."""
    _check_text(settings, body.text)
    session = await deps.active_session(host, sid)
    if scheduled_at(body.when):
        args = body.model_dump(include={"text", "allow_interruptions", "add_to_chat"})
        async with deps.deadline(settings):
            scheduled = await schedule(request, host.store, session, "say", args, body.when, idem, _say_scheduled)
        return _say_scheduled(scheduled)
    async with deps.deadline(settings):
        speech = await session.say(
            body.text,
            allow_interruptions=body.allow_interruptions,
            add_to_chat=body.add_to_chat,
            receipt=idem.receipt(_said),
        )
    audit.record(request, session, "say", speech_id=speech.id)
    return _said(speech)


def _interrupted(speech: SpeechHandle | None) -> InterruptResult:
    return InterruptResult(speech_id=speech.id if speech else None, interrupted=speech is not None)


def _interrupt_scheduled(scheduled: ScheduledRead) -> InterruptResult:
    return InterruptResult(speech_id=None, interrupted=False, scheduled=scheduled)


@router.post(
    "/{sid}/interrupt",
    operation_id="interrupt",
    response_model=InterruptResult,
    responses={
        202: {"model": InterruptResult, "description": "Scheduled (`when`): it applies when its point comes"},
        **problem_responses(
            400,
            404,
            408,
            (409, "The current speech does not allow interruptions, or the session is not active"),
            413,
            422,
        ),
    },
    dependencies=[Depends(Require("sessions:control"))],
)
@idempotent
async def interrupt(
    sid: str,
    services: ServicesDep,
    request: Request,
    response: Response,
    idem: Idem,
    body: InterruptCreate | None = None,
) -> InterruptResult:
    """Interrupt the current speech and the queued ones after it, up to the first that does not allow
    interruptions (`force`: all of them). Returns once the interrupted message (only what was heard) is committed;
    409 `not_interruptible` when the current speech does not allow interruptions and `force` is false."""
    body = body or InterruptCreate()
    session = await deps.active_session(services.host, sid)
    if scheduled_at(body.when):
        response.status_code = 202  # before the answer is recorded with the effect (an idempotent replay gets it)
        async with deps.deadline(services.settings):
            scheduled = await schedule(
                request,
                services.host.store,
                session,
                "interrupt",
                {"force": body.force},
                body.when,
                idem,
                _interrupt_scheduled,
            )
        return _interrupt_scheduled(scheduled)
    started = time.perf_counter()
    async with deps.deadline(services.settings):
        speech = await session.interrupt(force=body.force, receipt=idem.receipt(_interrupted))
    if speech is not None:
        services.metrics.interrupt_latency.observe(time.perf_counter() - started)
    audit.record(request, session, "interrupt", speech_id=speech.id if speech else None, force=body.force or None)
    return _interrupted(speech)


@router.get(
    "/{sid}/speeches/{speech_id}",
    operation_id="getSpeech",
    responses=problem_responses(404),
    response_model=SpeechRead,
    dependencies=[Depends(Require("sessions:read"))],
)
async def get_speech(sid: str, speech_id: str, services: ServicesDep, request: Request) -> SpeechRead | Response:
    """One speech: its state, whether it was interrupted, what was generated and what was heard (in cluster mode,
    as the node that runs the session knows it)."""
    session = await deps.known_session(services.host, sid)
    info = await session.speech(speech_id)
    if info is None:
        raise not_found("speech", speech_id)
    heard = info.heard_text if info.heard_text is not None else info.played_text
    return SpeechRead(**info.model_dump(exclude={"heard_text"}), heard_text=heard)


def _token_ttl_s(settings: Settings, session: SessionView, asked: int | None) -> int:
    """A token's lifetime: the one asked for (else the default), but never past its session's deletion. Once an
    ended session is deleted (``CLOSED_RETENTION_S`` after it ended) its id is free again, and a token still valid
    would read whichever session takes that id next. A live session ends now at the earliest."""
    ttl_s = asked or settings.token_ttl_s
    if settings.closed_retention_s <= 0:  # ended sessions are kept: an id is never taken twice
        return ttl_s
    ended_at = session.record.updated_at.timestamp() if session.ended else time.time()
    deleted_in_s = ended_at + settings.closed_retention_s - time.time()
    return max(1, min(ttl_s, math.floor(deleted_in_s)))


@router.post(
    "/{sid}/tokens",
    operation_id="createSessionToken",
    responses=problem_responses(*POST_ERRORS),
    status_code=201,
    response_model=TokenRead,
    dependencies=[Depends(Require("sessions:read", keys_only=True))],
)
@idempotent_sealed(seal_token, unseal_token)  # the record keeps no usable token
async def create_token(
    request: Request, session: KnownSession, settings: SettingsDep, body: TokenCreate | None = None
) -> TokenRead:
    """A short-lived token that can read this session and stream its events (for embedded dashboards), or, with
    `scopes: ["media:connect"]`, connect as its media edge (for a browser or a gateway). Needs an API key: a session
    token cannot create tokens."""
    body = body or TokenCreate()
    minter = principal_of(request)
    scopes = token_scopes(minter, list(body.scopes) if body.scopes else None)
    ttl_s = _token_ttl_s(settings, session, body.ttl_s)
    token, expires = issue_token(settings, session.id, ttl_s, scopes, minter=minter.budget)
    return TokenRead(
        token=token,
        session_id=session.id,
        scopes=list(scopes),
        expires_at=datetime.fromtimestamp(expires, tz=UTC),
    )
