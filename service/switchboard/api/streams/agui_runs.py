"""AG-UI runs: a client posts a ``RunAgentInput`` and gets the run it starts, as Server-Sent Events.

The input's last message, the user's, is the session's input (it interrupts as ``POST /input`` does), injected at
most once per ``runId`` (the run's idempotency key, in the same records as ``Idempotency-Key``): a retried POST of
the same run injects nothing and streams the same run. The answer is the session's log from just before the input,
translated by a ``RunTranslator``: ``RUN_STARTED`` under the client's ``runId``, the run, ``RUN_FINISHED`` (or
``RUN_ERROR``), then the response ends. Every event carries its position in ``rawEvent``; a POST of the same run with
``Last-Event-ID`` continues after it. A client that goes away before the end interrupts the run's speech. In cluster
mode the node a run is posted to serves it, and the session's node applies its input and the interrupt
(``agui_relay``). ``docs/ag-ui.md`` has the details.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection
from typing import Annotated, Any

from ag_ui.core import BaseEvent, RunAgentInput, TextInputContent, UserMessage
from fastapi import APIRouter, Depends, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from ...control.cluster.routing import Elsewhere, locate
from ...control.host import SessionHost
from ...control.hub import SubscriberOverflow
from ...runtime.aio import cancel_and_wait, spawn
from ...runtime.session import InputResult
from ...runtime.speech import NotInterruptible
from ...runtime.status import SessionStatus
from ...runtime.text import valid_text
from ...store import IdempotencyState
from .. import audit, deps
from ..auth import AuthError, Principal, Require, check, principal_of
from ..cluster.forward import FORWARDED_HEADER, SessionElsewhere
from ..idempotency import MAX_KEY_LEN, Attempt, KeyedCommands
from ..openapi_doc import API_KEY, security
from ..problems import POST_ERRORS, ProblemError, problem_responses
from ..schemas import SessionCreate
from .agui import RunTranslator, encode_sse
from .agui_relay import Part, RunPart, RunRelay, create_at, run_part
from .agui_routes import KEEPALIVE_S, SSE_EVENT, SSE_HEADERS, TOO_SLOW, resume_point, sse_chunk
from .session_stream import open_session_log
from .stream_slots import TooManyStreams

logger = logging.getLogger("switchboard.api.streams.agui_runs")
router = APIRouter(tags=["events"])

RUNS = KeyedCommands()  # a run's input, keyed by its runId
_ABORTS: set[asyncio.Task[Any]] = set()  # interrupts of runs whose client went away

RUN_ANSWER: dict[Any, Any] = {
    200: {
        "description": "The run as AG-UI events (Server-Sent Events), from `RUN_STARTED` to `RUN_FINISHED` or "
        "`RUN_ERROR`; each event carries its position in `rawEvent.seq` (and each session event's last one, "
        "`id: <seq>`). Post the same run again with `Last-Event-ID` to continue after a position.",
        "content": {"text/event-stream": {"schema": SSE_EVENT}},
    },
    **problem_responses(*POST_ERRORS, 403, 422),
}
LAST_EVENT_ID = Header(alias="Last-Event-ID", description="Continue the run after this position (`rawEvent.seq`).")
_ANY = {"description": "Any JSON value."}
# the body, documented in brief: the AG-UI SDK's own model of it (what the route validates with) makes a schema
# of every message and content kind, most of it about what a run here never reads
RUN_INPUT = {
    "type": "object",
    "description": "An AG-UI `RunAgentInput` (https://docs.ag-ui.com/concepts/architecture), camelCase. The last of "
    "`messages` must be the user's: it is the run's input. `state`, `tools`, `context` and `forwardedProps` are "
    "accepted and not used.",
    "required": ["threadId", "runId", "messages"],
    "properties": {
        "threadId": {"type": "string", "description": "The session's id."},
        "runId": {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_KEY_LEN,
            "description": "The run's id: its input is injected once per runId.",
        },
        "messages": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "role"],
                "properties": {"id": {"type": "string"}, "role": {"type": "string"}, "content": _ANY},
            },
        },
        "state": _ANY,
        "tools": {"type": "array", "items": {"type": "object"}},
        "context": {"type": "array", "items": {"type": "object"}},
        "forwardedProps": _ANY,
    },
}


def _run_doc(*scopes: str) -> dict[str, Any]:
    """The operation's body and security: an API key with all of ``scopes`` (a session token cannot hold them)."""
    body = {"required": True, "content": {"application/json": {"schema": RUN_INPUT}}}
    return {"requestBody": body, **security({API_KEY: list(scopes)})}


async def _run_input(request: Request) -> RunAgentInput:
    """The request's body as a ``RunAgentInput`` (422 like any other invalid body)."""
    try:
        raw = await request.json()
    except ValueError:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": "Invalid JSON"}]) from None
    try:
        body = RunAgentInput.model_validate(raw)
    except ValidationError as err:
        raise RequestValidationError(err.errors(include_url=False, include_context=False)) from None
    if not 1 <= len(body.run_id) <= MAX_KEY_LEN:  # it is the run's idempotency key
        raise ProblemError(422, "invalid_run_id", f"runId must be 1-{MAX_KEY_LEN} characters.")
    return body


def _user_text(body: RunAgentInput) -> tuple[str, str]:
    """The run's input: the id and text of the input's last message, which must be the user's."""
    last = body.messages[-1] if body.messages else None
    if not isinstance(last, UserMessage):
        raise ProblemError(422, "no_user_message", "A run starts with a user message: the last of `messages`.")
    content = last.content
    text = content if isinstance(content, str) else "".join(p.text for p in content if isinstance(p, TextInputContent))
    text = valid_text(text)  # as every REST body's text: a lone surrogate is stored as U+FFFD, never as it came
    if not text.strip():
        raise ProblemError(422, "no_user_message", "The last user message has no text.")
    return last.id, text


@router.post(
    "/v1/sessions/{sid}/ag-ui",
    operation_id="runSessionAgui",
    summary="Run a turn of the session (AG-UI)",
    response_class=StreamingResponse,
    responses=RUN_ANSWER,
    dependencies=[Depends(Require("sessions:control")), Depends(Require("events:read"))],
    openapi_extra=_run_doc("sessions:control", "events:read"),
)
async def run_session_agui(
    request: Request,
    sid: str,
    last_event_id: Annotated[str | None, LAST_EVENT_ID] = None,
) -> Response:
    """Start an AG-UI run (docs/ag-ui.md): the last message of `messages`, the user's, is the session's input (it
    interrupts the agent as `POST /input` does), and the answer is that run, until it finishes. `threadId` must be
    the session's id. The input is injected once per `runId`: posting the same run again streams it again."""
    body = await _run_input(request)
    if body.thread_id != sid:
        raise ProblemError(422, "thread_mismatch", f"threadId must be the session's id, {sid!r}.")
    return await _start(request, sid, body, last_event_id)


@router.post(
    "/v1/agents/{agent}/ag-ui",
    operation_id="runAgentAgui",
    summary="Run a turn with an agent (AG-UI)",
    response_class=StreamingResponse,
    responses=RUN_ANSWER,
    dependencies=[Depends(Require("sessions:write", keys_only=True))],
    openapi_extra=_run_doc("sessions:write", "sessions:control", "events:read"),
)
async def run_agent_agui(
    request: Request,
    agent: str,
    last_event_id: Annotated[str | None, LAST_EVENT_ID] = None,
) -> Response:
    """Start an AG-UI run with `agent` (docs/ag-ui.md): `threadId` names the session, created with this agent on
    its first run and continued after (409 `thread_agent_mismatch` when it runs another agent). Needs
    `sessions:write`, `sessions:control` and `events:read`."""
    body = await _run_input(request)
    principal = principal_of(request)
    sid = body.thread_id
    try:
        check(principal, "sessions:control", sid)
        check(principal, "events:read", sid)
    except AuthError as err:
        raise ProblemError(err.status, err.code, err.detail) from None
    await _thread_session(request, principal, agent, sid)
    return await _start(request, sid, body, last_event_id)


async def _thread_session(request: Request, principal: Principal, agent: str, sid: str) -> None:
    """The thread's session: created with ``agent`` when it does not exist yet, where a create would place it."""
    services = deps.services(request)
    host = services.host
    found = await host.find(sid)
    if found is not None:
        started_with = found.record.config.get("agent", found.record.agent)  # the agent it may have handed off since
        if started_with != agent:
            raise ProblemError(409, "thread_agent_mismatch", f"Thread {sid!r} runs agent {started_with!r}.")
        return
    try:
        create = SessionCreate(id=sid, agent=agent)
    except ValidationError:
        raise ProblemError(422, "invalid_thread_id", "threadId is not a valid session id.") from None
    try:
        await deps.place_new_session(host, FORWARDED_HEADER in request.headers)
    except SessionElsewhere as target:
        await create_at(request, target, sid, agent)
        return
    owner = principal.identity if services.settings.auth_enabled else None
    async with deps.deadline(services.settings):
        await host.create(create.session_config().model_copy(update={"owner": owner}), create.metadata)


async def _start(request: Request, sid: str, body: RunAgentInput, last_event_id: str | None) -> Response:
    services = deps.services(request)
    principal = principal_of(request)
    scope = f"{principal.identity} POST /v1/sessions/{sid}/ag-ui"  # both doors: one run, one key
    part = run_part(request)
    if part is not None:
        return await _owner_part(request, sid, body, scope, part)
    resume = resume_point(None, last_event_id) if last_event_id is not None else None
    # a run continued on a new connection is known by its runId alone: its client's messages have grown since
    started = await _started_before(services, body.run_id, scope) if resume is not None else None
    if started is None:
        _run_text(services, body)
    try:
        release = services.streams.acquire(principal.budget, operator=principal.operator)
    except TooManyStreams as err:
        raise ProblemError(429, "too_many_streams", err.reason, headers={"Retry-After": "1"}) from None
    try:
        relay = await RunRelay.of(request, sid)
        if started is None:
            started = await _apply(request, sid, body, scope, relay)
    except BaseException:
        release()
        raise
    run = RunTranslator(sid, body.run_id, str(started["item_id"]))
    abort = _Abort(sid, run, started, request, relay)
    return RunStream(services, run, int(started["since"]), resume, release, abort)


def _run_text(services: deps.Services, body: RunAgentInput) -> tuple[str, str]:
    """The run's input (``_user_text``), within the size limit."""
    message_id, text = _user_text(body)
    limit = services.settings.max_text_chars
    if len(text) > limit:
        raise ProblemError(413, "text_too_long", f"text is {len(text)} characters; the limit is {limit}.")
    return message_id, text


async def _apply(request: Request, sid: str, body: RunAgentInput, scope: str, relay: RunRelay | None) -> dict[str, Any]:
    """Inject the run's input, once per runId: here, or by the node that runs the session."""
    if relay is not None:
        where = await locate(deps.services(request).host, sid)
        if isinstance(where, Elsewhere):
            return await relay.inject(where)
    message_id, text = _run_text(deps.services(request), body)
    key_body = {"message_id": message_id, "text": text}
    started: dict[str, Any] = await RUNS.run(
        request, body.run_id, scope, key_body, lambda idem: _inject(request, sid, text, body.run_id, idem)
    )
    return started


async def _owner_part(request: Request, sid: str, body: RunAgentInput, scope: str, part: RunPart) -> Response:
    """What the node serving a run of this node's session asks of it (``agui_relay``)."""
    if part.kind is Part.INPUT:
        return JSONResponse(await _apply(request, sid, body, scope, None))
    await interrupt_speaking(deps.services(request).host, sid, part.speeches, audit.actor_of(request))
    return Response(status_code=204)


async def _started_before(services: deps.Services, run_id: str, scope: str) -> dict[str, Any] | None:
    """What the input of run ``run_id`` answered, when it was injected already."""
    found = await services.store.idempotency.find(run_id, scope)
    if found is None or found.state is not IdempotencyState.DONE or not isinstance(found.response_body, dict):
        return None
    return found.response_body


async def _inject(request: Request, sid: str, text: str, run_id: str, attempt: Attempt) -> dict[str, Any]:
    """Inject the run's input; the answer: its chat item and speech, and where the log stood before it."""
    services = deps.services(request)
    session = await deps.active_session(services.host, sid)
    since = session.events.last_seq

    def started(result: InputResult) -> dict[str, Any]:
        return {"item_id": result.item_id, "speech_id": result.speech_id, "since": since}

    async with deps.deadline(services.settings):
        result = await session.input(text, receipt=attempt.receipt(started))
    audit.record_as(
        audit.actor_of(request), session, "input", run_id, item_id=result.item_id, speech_id=result.speech_id
    )
    return started(result)


class _Abort:
    """What a client that goes away before its run ends does: interrupt the agent when it is still speaking one of
    the run's speeches (never another run's), on whichever node runs the session."""

    def __init__(
        self, sid: str, run: RunTranslator, started: dict[str, Any], request: Request, relay: RunRelay | None
    ) -> None:
        self.sid, self.run, self.speech_id, self.relay = sid, run, started.get("speech_id"), relay
        self.actor = audit.actor_of(request)
        self.services = deps.services(request)

    def __call__(self) -> None:
        spawn(self._interrupt(), name=f"agui-abort:{self.sid}", tasks=_ABORTS)

    async def _interrupt(self) -> None:
        speeches = {str(s) for s in (self.speech_id, *self.run.spoken) if s is not None}
        if self.relay is not None:
            where = await locate(self.services.host, self.sid)
            if isinstance(where, Elsewhere):
                await self.relay.abort(where, speeches)
                return
        await interrupt_speaking(self.services.host, self.sid, speeches, self.actor)


async def interrupt_speaking(host: SessionHost, sid: str, speeches: Collection[str], actor: str) -> None:
    """Interrupt the agent of session ``sid``, live on this node, if it is speaking one of ``speeches``."""
    view = await host.find(sid)
    session = view.live if view is not None else None
    if session is None or session.state != SessionStatus.ACTIVE:
        return
    current = session.current_speech
    if current is None or current.id not in speeches:
        return
    with contextlib.suppress(NotInterruptible):
        speech = await session.interrupt()
        if speech is not None:
            audit.record_as(actor, session, "interrupt", speech_id=speech.id)


class RunStream(StreamingResponse):
    """The run's SSE response: the session's log after ``since`` through the run's translator, until the run ends
    (events up to ``resume`` are translated, not sent: a continued run starts again with ``RUN_STARTED``). A client
    that disconnects first calls ``abort``."""

    def __init__(
        self,
        services: deps.Services,
        run: RunTranslator,
        since: int,
        resume: int | None,
        release: Callable[[], None],
        abort: Callable[[], None],
    ) -> None:
        super().__init__((), media_type="text/event-stream", headers=SSE_HEADERS)
        self._services, self._run, self._since, self._resume = services, run, since, resume
        self._release, self._abort = release, abort

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        metrics = self._services.metrics
        metrics.ws_connections.inc()
        try:
            stream = asyncio.create_task(self._respond(send), name=f"agui-run:{self._run.client_run_id}")
            gone = asyncio.create_task(_disconnected(receive))
            try:
                done, _ = await asyncio.wait({stream, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                await cancel_and_wait(stream, gone)
            if stream in done:
                stream.result()
            elif not self._run.over:  # the client went away during its run
                self._abort()
        finally:
            metrics.ws_connections.dec()
            self._release()

    async def _respond(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            await self._stream(send)
        except SubscriberOverflow:  # nothing is lost: the client posts the run again with the position it holds
            await send(sse_chunk(TOO_SLOW))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _stream(self, send: Send) -> None:
        services, run = self._services, self._run
        sub, log = await open_session_log(
            services.host.hub,
            services.store,
            run.thread_id,
            self._since,
            None,
            maxsize=services.settings.ws_buffer,
            has_ended=self._has_ended,
            heartbeat_s=KEEPALIVE_S,
        )
        muted = self._resume
        with sub:
            async with contextlib.aclosing(log):
                async for item in log:
                    if item is None:
                        await send(sse_chunk(": keepalive\n\n"))
                        continue
                    event, _ = item
                    made: list[BaseEvent] = []
                    if muted is not None and event.seq > muted:
                        if run.opened:  # continued on a new connection: a run of its own again
                            made.append(run.restarted(int(event.at.timestamp() * 1000)))
                        muted = None
                    made += run.translate(event)
                    if muted is None and made:  # else the client has it already
                        await send(sse_chunk(encode_sse(made, event.seq)))
                    if run.over:
                        return

    async def _has_ended(self) -> bool:
        session = await self._services.host.find(self._run.thread_id)
        return session is not None and session.ended


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
