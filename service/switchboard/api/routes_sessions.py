"""Sessions: create, list, read, close; operator commands (input, say, interrupt); chat and speeches."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response

from ..host import SessionConflict, TooManySessions
from ..runtime.agent import UnknownAgent
from ..runtime.session import SessionClosed
from ..runtime.speech import NotInterruptible
from . import deps
from .auth import TOKEN_SCOPES, Require, issue_token
from .idempotency import IdempotencyGuard
from .problems import POST_ERRORS, ProblemError, not_found, problem_responses
from .schemas import (
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
    SpeechRead,
    TokenCreate,
    TokenRead,
)

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])
guard = IdempotencyGuard()


def _check_text(request: Request, text: str) -> None:
    limit = deps.settings(request).max_text_chars
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
async def create_session(request: Request, body: SessionCreate) -> Any:
    """Create a live session running `agent`. Creating the same `id` again with the same body returns it (200);
    with a different body it is a conflict (409)."""
    raw = body.model_dump(exclude_none=True, exclude={"metadata"}, mode="json")

    async def handler() -> tuple[int, Any]:
        host = deps.host(request)
        try:
            async with deps.deadline(request):
                rec, created = await host.create(raw, body.metadata)
        except UnknownAgent as err:
            raise ProblemError(422, "unknown_agent", str(err)) from None
        except ValueError as err:  # bad llm / options configuration
            raise ProblemError(422, "invalid_session_config", str(err)) from None
        except SessionConflict:
            raise ProblemError(409, "session_exists", f"Session {raw['id']!r} exists with a different body.") from None
        except TooManySessions as err:
            raise ProblemError(429, "too_many_sessions", str(err), headers={"Retry-After": "5"}) from None
        live = host.live(rec.id)
        return (201 if created else 200), deps.session_read(rec, live).model_dump(mode="json")

    return await guard.run(request, body.model_dump(mode="json"), handler)


@router.get(
    "",
    operation_id="listSessions",
    response_model=SessionList,
    dependencies=[Depends(Require("sessions:read"))],
)
async def list_sessions(
    request: Request,
    state: Annotated[str | None, Query(max_length=32)] = None,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> SessionList:
    """List sessions, newest first, optionally by `state` (active, closed, failed)."""
    host = deps.host(request)
    try:
        records, next_cursor = await deps.store(request).list_sessions(state=state, cursor=cursor, limit=limit)
    except ValueError:
        raise ProblemError(422, "invalid_cursor", "The cursor is not valid.") from None
    items = [deps.session_read(rec, host.live(rec.id)) for rec in records]
    return SessionList(items=items, next_cursor=next_cursor)


@router.get(
    "/{sid}",
    operation_id="getSession",
    responses=problem_responses(404),
    response_model=SessionRead,
    dependencies=[Depends(Require("sessions:read"))],
)
async def get_session(request: Request, sid: str) -> SessionRead:
    """Read one session."""
    host = deps.host(request)
    live = host.live(sid)
    rec = host.records.get(sid) if live else await deps.store(request).get_session(sid)
    if rec is None:
        raise not_found("session", sid)
    return deps.session_read(rec, live)


@router.delete(
    "/{sid}",
    operation_id="closeSession",
    responses=problem_responses(404),
    status_code=204,
    response_class=Response,
    dependencies=[Depends(Require("sessions:write"))],
)
async def close_session(request: Request, sid: str) -> Response:
    """Close a session: stop speaking, cancel cancellable tools, await the others, emit the final events."""
    host = deps.host(request)
    if not await host.close(sid) and await deps.store(request).get_session(sid) is None:
        raise not_found("session", sid)
    return Response(status_code=204)


@router.get(
    "/{sid}/chat",
    operation_id="getChat",
    responses=problem_responses(404),
    response_model=ChatRead,
    dependencies=[Depends(Require("sessions:read"))],
)
async def get_chat(request: Request, sid: str) -> ChatRead:
    """The session's chat context in conversation order (each tool output right after its call)."""
    live = await deps.known_session(request, sid)
    if live is not None:
        return ChatRead(items=live.chat.items)
    return ChatRead(items=await deps.store(request).chat_items(sid))


@router.post(
    "/{sid}/input",
    operation_id="injectInput",
    responses=problem_responses(*POST_ERRORS),
    status_code=202,
    response_model=InputAccepted,
    dependencies=[Depends(Require("sessions:control"))],
)
async def inject_input(request: Request, sid: str, body: InputCreate) -> Any:
    """Inject user input. `final=false` is an interim transcript (reported, not committed). A final input
    interrupts the current speech when `interrupt` is true and it allows it (or `force`), and queues a reply."""
    _check_text(request, body.text)

    async def handler() -> tuple[int, Any]:
        session = await deps.live_or_409(request, sid)
        try:
            async with deps.deadline(request):
                result = await session.input(
                    body.text,
                    final=body.final,
                    interrupt=body.interrupt,
                    force=body.force,
                    reply=body.reply,
                    role=body.role,
                )
        except SessionClosed as err:
            raise ProblemError(409, "session_not_active", str(err)) from None
        return 202, InputAccepted(item_id=result.item_id, speech_id=result.speech_id).model_dump(mode="json")

    return await guard.run(request, body.model_dump(mode="json"), handler)


@router.post(
    "/{sid}/say",
    operation_id="say",
    responses=problem_responses(*POST_ERRORS),
    status_code=202,
    response_model=SayAccepted,
    dependencies=[Depends(Require("sessions:control"))],
)
async def say(request: Request, sid: str, body: SayCreate) -> Any:
    """Have the agent say `text` verbatim, after anything already queued."""
    _check_text(request, body.text)

    async def handler() -> tuple[int, Any]:
        session = await deps.live_or_409(request, sid)
        try:
            async with deps.deadline(request):
                speech = await session.say(
                    body.text, allow_interruptions=body.allow_interruptions, add_to_chat=body.add_to_chat
                )
        except SessionClosed as err:
            raise ProblemError(409, "session_not_active", str(err)) from None
        return 202, SayAccepted(speech_id=speech.id).model_dump(mode="json")

    return await guard.run(request, body.model_dump(mode="json"), handler)


@router.post(
    "/{sid}/interrupt",
    operation_id="interrupt",
    response_model=InterruptResult,
    responses=problem_responses(
        400, 404, 408, (409, "The current speech does not allow interruptions, or the session is not active"), 413
    ),
    dependencies=[Depends(Require("sessions:control"))],
)
async def interrupt(request: Request, sid: str, body: InterruptCreate | None = None) -> Any:
    """Interrupt the current speech. Returns once the interrupted message (only what was heard) is committed."""
    body = body or InterruptCreate()

    async def handler() -> tuple[int, Any]:
        session = await deps.live_or_409(request, sid)
        started = time.perf_counter()
        try:
            async with deps.deadline(request):
                speech = await session.interrupt(force=body.force)
        except NotInterruptible as err:
            raise ProblemError(409, "not_interruptible", str(err)) from None
        except SessionClosed as err:
            raise ProblemError(409, "session_not_active", str(err)) from None
        if speech is not None:
            request.app.state.metrics.interrupt_latency.observe(time.perf_counter() - started)
        result = InterruptResult(speech_id=speech.id if speech else None, interrupted=speech is not None)
        return 200, result.model_dump(mode="json")

    return await guard.run(request, body.model_dump(mode="json"), handler)


@router.get(
    "/{sid}/speeches/{speech_id}",
    operation_id="getSpeech",
    responses=problem_responses(404),
    response_model=SpeechRead,
    dependencies=[Depends(Require("sessions:read"))],
)
async def get_speech(request: Request, sid: str, speech_id: str) -> SpeechRead:
    """One speech: its state, whether it was interrupted, what was generated and what was heard."""
    live = await deps.known_session(request, sid)
    handle = live.speech(speech_id) if live else None
    if handle is not None:
        return SpeechRead(**handle.info().model_dump())
    info = await deps.store(request).speech(sid, speech_id)
    if info is None:
        raise not_found("speech", speech_id)
    return SpeechRead(**info.model_dump())


@router.post(
    "/{sid}/tokens",
    operation_id="createSessionToken",
    responses=problem_responses(*POST_ERRORS),
    status_code=201,
    response_model=TokenRead,
    dependencies=[Depends(Require("sessions:read", keys_only=True))],
)
async def create_token(request: Request, sid: str, body: TokenCreate | None = None) -> Any:
    """A short-lived token that can read this session and stream its events (for embedded dashboards). Needs an
    API key: a session token cannot create tokens."""
    body = body or TokenCreate()
    await deps.known_session(request, sid)

    async def handler() -> tuple[int, Any]:
        token, expires = issue_token(deps.settings(request), sid, body.ttl_s)
        read = TokenRead(
            token=token,
            session_id=sid,
            scopes=list(TOKEN_SCOPES),
            expires_at=datetime.fromtimestamp(expires, tz=UTC),
        )
        return 201, read.model_dump(mode="json")

    return await guard.run(request, body.model_dump(mode="json"), handler)
