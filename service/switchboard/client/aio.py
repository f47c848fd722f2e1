"""The asyncio client: the same operations as :class:`~switchboard.client.sync.Client`, awaited."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal

import httpx

from . import _ops
from ._http import Call, RetryPolicy, T, asend, auth_headers
from .events import AsyncEventStream, ResumeHook, stream_position
from .media import MediaConnection, media_url
from .models import (
    AgentInfo,
    Alert,
    ChatItem,
    CoachAccepted,
    HandBack,
    Health,
    InputAccepted,
    InterruptResult,
    SayAccepted,
    ScheduledCommand,
    Session,
    SessionExport,
    SessionList,
    SessionToken,
    Speech,
    Takeover,
    ToolCall,
    ToolCallList,
    ToolReport,
    ToolStatus,
)
from .sync import DEFAULT_TIMEOUT_S, DEFAULT_URL, RECONNECT_FOR_S


class AsyncClient:
    """An asyncio client of a Switchboard service.

    >>> async with AsyncClient("http://127.0.0.1:8080", api_key="...") as sb:
    ...     session = await sb.create_session("demo")
    ...     await sb.input(session.id, "Where is my order?")
    ...     async for event in sb.events(session.id, types=["tool.*"]):
    ...         print(event.seq, event.type, event.data)

    Errors are :class:`~switchboard.client.errors.SwitchboardError` subclasses. Commands carry an
    ``Idempotency-Key`` (generated, or ``idempotency_key=``) that their retries reuse.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy | None = None,
        reconnect_for_s: float = RECONNECT_FOR_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self.reconnect_for_s = reconnect_for_s
        self._headers = auth_headers(api_key)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers, timeout=timeout_s, transport=transport
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def _send(self, call: Call[T]) -> T:
        return await asend(self._http, self.retry, call)

    # -- sessions --------------------------------------------------------------------------------------------------

    async def create_session(
        self,
        agent: str,
        *,
        id: str | None = None,
        llm: Mapping[str, Any] | None = None,
        playout: Mapping[str, Any] | None = None,
        preemptive_generation: bool | None = None,
        allow_interruptions: bool | None = None,
        max_tool_steps: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> Session:
        """Start a live session running ``agent``. The same ``id`` with the same options returns the session;
        with other options it is a ``Conflict`` (``session_exists``)."""
        return await self._send(
            _ops.create_session(
                agent,
                id=id,
                llm=llm,
                playout=playout,
                preemptive_generation=preemptive_generation,
                allow_interruptions=allow_interruptions,
                max_tool_steps=max_tool_steps,
                metadata=metadata,
                idempotency_key=idempotency_key,
            )
        )

    async def list_sessions(
        self,
        *,
        state: str | None = None,
        agent: str | None = None,
        attention: bool = False,
        cursor: str | None = None,
        limit: int | None = None,
    ) -> SessionList:
        """One page of sessions, newest first; pass ``next_cursor`` back as ``cursor`` for the next. ``agent``: only
        sessions of that agent; ``attention``: only the sessions that need an operator (in one page; in cluster mode
        the nodes that did not answer in time are in ``missing_nodes``)."""
        return await self._send(_ops.list_sessions(state, cursor, limit, agent=agent, attention=attention))

    async def list_agents(self) -> list[AgentInfo]:
        """The registered agents, with their tools and default model."""
        return await self._send(_ops.list_agents())

    async def list_alerts(
        self, *, include_cleared: bool = False, session_id: str | None = None, limit: int | None = None
    ) -> list[Alert]:
        """The alerts sent to the server's webhook sinks, newest first: the open ones (``include_cleared``: all), each
        with its deliveries to each sink."""
        return await self._send(_ops.list_alerts(include_cleared=include_cleared, session_id=session_id, limit=limit))

    async def get_agent(self, name: str) -> AgentInfo:
        return await self._send(_ops.get_agent(name))

    async def iter_sessions(self, *, state: str | None = None, page_size: int | None = None) -> AsyncIterator[Session]:
        """Every session, newest first, page after page."""
        cursor: str | None = None
        while True:
            page = await self.list_sessions(state=state, cursor=cursor, limit=page_size)
            for session in page.items:
                yield session
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def get_session(self, sid: str) -> Session:
        return await self._send(_ops.get_session(sid))

    async def close_session(self, sid: str) -> None:
        """Close a session: returns once its tools have ended and its final events are written."""
        await self._send(_ops.close_session(sid))

    async def get_chat(self, sid: str) -> list[ChatItem]:
        """The chat context in conversation order (each tool output right after its call), every page of it."""
        items: list[ChatItem] = []
        cursor: str | None = None
        while True:
            page = await self._send(_ops.get_chat(sid, cursor))
            items.extend(page.items)
            if page.next_cursor is None:
                return items
            cursor = page.next_cursor

    # -- operator commands -----------------------------------------------------------------------------------------

    async def input(
        self,
        sid: str,
        text: str,
        *,
        final: bool = True,
        interrupt: bool = True,
        force: bool = False,
        reply: bool = True,
        role: _ops.Role = "user",
        idempotency_key: str | None = None,
        when: _ops.When = None,
    ) -> InputAccepted:
        """Inject user input (``final=False``: an interim transcript, not committed). ``when`` schedules it for a
        point of the conversation instead of now: ``"idle"``, ``"after_speech"``, ``"after_tool:CALL_ID"`` (the
        answer's ``scheduled`` then says where it stands)."""
        call = _ops.input(
            sid,
            text,
            final=final,
            interrupt=interrupt,
            force=force,
            reply=reply,
            role=role,
            idempotency_key=idempotency_key,
            when=when,
        )
        return await self._send(call)

    async def say(
        self,
        sid: str,
        text: str,
        *,
        allow_interruptions: bool = True,
        add_to_chat: bool = True,
        idempotency_key: str | None = None,
        when: _ops.When = None,
    ) -> SayAccepted:
        """Have the agent say ``text`` verbatim, after anything already queued (``when``: at that point of the
        conversation instead, see ``input``)."""
        call = _ops.say(
            sid,
            text,
            allow_interruptions=allow_interruptions,
            add_to_chat=add_to_chat,
            idempotency_key=idempotency_key,
            when=when,
        )
        return await self._send(call)

    async def interrupt(
        self, sid: str, *, force: bool = False, idempotency_key: str | None = None, when: _ops.When = None
    ) -> InterruptResult:
        """Interrupt the current speech; returns once what was heard is committed. ``Conflict``
        (``not_interruptible``) when the speech does not allow it, unless ``force``. ``when``: at that point of the
        conversation instead (see ``input``)."""
        return await self._send(_ops.interrupt(sid, force=force, idempotency_key=idempotency_key, when=when))

    async def coach(self, sid: str, note: str, *, idempotency_key: str | None = None) -> CoachAccepted:
        """Leave ``note`` for the agent's next model request only (the user never sees it)."""
        return await self._send(_ops.coach(sid, note, idempotency_key=idempotency_key))

    async def list_scheduled(self, sid: str, *, pending_only: bool = False) -> list[ScheduledCommand]:
        """The session's scheduled commands and coaching notes, oldest first (``pending_only``: those pending)."""
        return (await self._send(_ops.list_scheduled(sid, pending_only=pending_only))).items

    async def get_scheduled(self, sid: str, scheduled_id: str) -> ScheduledCommand:
        return await self._send(_ops.get_scheduled(sid, scheduled_id))

    async def cancel_scheduled(self, sid: str, scheduled_id: str) -> ScheduledCommand:
        """Cancel a pending scheduled command or note; ``Conflict`` (``already_ended``) once applied or cancelled."""
        return await self._send(_ops.cancel_scheduled(sid, scheduled_id))

    async def take_over(self, sid: str, *, force: bool = False, idempotency_key: str | None = None) -> Takeover:
        """Take the session over as this client's operator: the speech under way is interrupted and the model is
        asked for nothing until ``hand_back``. Again by the holder: a heartbeat. ``Conflict`` (``held_by_other``)
        when another operator holds it, unless ``force``."""
        return await self._send(_ops.take_over(sid, force=force, idempotency_key=idempotency_key))

    async def takeover_say(self, sid: str, text: str, *, idempotency_key: str | None = None) -> SayAccepted:
        """Speak ``text`` as the agent, as the operator holding the session. ``Conflict`` (``not_held``,
        ``held_by_other``) when this client does not hold it."""
        return await self._send(_ops.takeover_say(sid, text, idempotency_key=idempotency_key))

    async def hand_back(self, sid: str, *, force: bool = False) -> HandBack:
        """Hand the session back to the agent; it replies when the user's last input is unanswered (``speech_id``).
        ``Conflict`` (``not_held``; ``held_by_other`` unless ``force``)."""
        return await self._send(_ops.hand_back(sid, force=force))

    async def export_session(self, sid: str) -> SessionExport:
        """The whole session as one document: the session, its chat, its tool calls and its event log (the
        operators' actions included); for closed sessions too."""
        return await self._send(_ops.export_session(sid))

    async def get_speech(self, sid: str, speech_id: str) -> Speech:
        return await self._send(_ops.get_speech(sid, speech_id))

    # -- tool calls ------------------------------------------------------------------------------------------------

    async def list_tool_calls(
        self, sid: str, *, status: ToolStatus | str | None = None, page_size: int | None = None
    ) -> list[ToolCall]:
        """The session's tool calls by start time (only those in ``status``, if given), every page of them."""
        calls: list[ToolCall] = []
        cursor: str | None = None
        while True:
            page = await self.tool_calls_page(sid, status=status, cursor=cursor, limit=page_size)
            calls.extend(page.items)
            if page.next_cursor is None:
                return calls
            cursor = page.next_cursor

    async def tool_calls_page(
        self,
        sid: str,
        *,
        status: ToolStatus | str | None = None,
        cursor: str | None = None,
        limit: int | None = None,
    ) -> ToolCallList:
        """One page of the session's tool calls; pass ``next_cursor`` back as ``cursor`` for the next."""
        return await self._send(_ops.list_tool_calls(sid, status, cursor, limit))

    async def get_tool_call(self, sid: str, call_id: str) -> ToolCall:
        return await self._send(_ops.get_tool_call(sid, call_id))

    async def cancel_tool_call(
        self, sid: str, call_id: str, *, force: bool = False, idempotency_key: str | None = None
    ) -> ToolCall:
        """Cancel a running, cancellable call; returns it once it has ended ``cancelled``. ``Conflict`` with code
        ``not_cancellable`` or ``already_ended`` otherwise, or ``not_interruptible`` while the speech that made
        the call does not allow interruptions (unless ``force``)."""
        return await self._send(_ops.cancel_tool_call(sid, call_id, force=force, idempotency_key=idempotency_key))

    async def list_running_tool_calls(self, *, limit: int | None = None) -> list[ToolCall]:
        """Running tool calls across every live session, oldest first, page after page (at most ``limit``)."""
        calls: list[ToolCall] = []
        cursor: str | None = None
        while limit is None or len(calls) < limit:
            size = None if limit is None else min(limit - len(calls), _ops.TOOL_CALL_PAGE_MAX)
            page = await self.running_tool_calls_page(cursor=cursor, limit=size)
            calls.extend(page.items)
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        return calls

    async def running_tool_calls_page(self, *, cursor: str | None = None, limit: int | None = None) -> ToolCallList:
        """One page of the running tool calls across every live session; pass ``next_cursor`` back as ``cursor``."""
        return await self._send(_ops.list_running_tool_calls(cursor, limit))

    async def report_tool_progress(
        self,
        sid: str,
        call_id: str,
        message: str,
        *,
        report_token: str,
        progress: float | None = None,
        idempotency_key: str | None = None,
    ) -> ToolReport:
        """From a webhook tool's backend (it answered 202): progress of the call. ``report_token`` is the one its
        delivery carried (a report without it is refused)."""
        call = _ops.report_tool_progress(
            sid, call_id, message, report_token=report_token, progress=progress, idempotency_key=idempotency_key
        )
        return await self._send(call)

    async def report_tool_result(
        self,
        sid: str,
        call_id: str,
        output: str,
        *,
        report_token: str,
        is_error: bool = False,
        idempotency_key: str | None = None,
    ) -> ToolReport:
        """From a webhook tool's backend (it answered 202): the call's result, with the ``report_token`` of its
        delivery; returns the call's status once it has ended."""
        call = _ops.report_tool_result(
            sid, call_id, output, report_token=report_token, is_error=is_error, idempotency_key=idempotency_key
        )
        return await self._send(call)

    # -- tokens and health -----------------------------------------------------------------------------------------

    async def create_token(
        self,
        sid: str,
        *,
        ttl_s: int | None = None,
        idempotency_key: str | None = None,
        scopes: list[str] | None = None,
    ) -> SessionToken:
        """A short-lived token that can read this session and stream its events (for a dashboard), or with
        ``scopes=["media:connect"]`` connect as its media edge (the key must hold that scope)."""
        call = _ops.create_token(sid, ttl_s=ttl_s, idempotency_key=idempotency_key, scopes=scopes)
        return await self._send(call)

    async def health(self) -> Health:
        return await self._send(_ops.health())

    async def ready(self) -> Health:
        """Whether the service reaches its database (``status`` "unavailable" when not; no error raised)."""
        return await self._send(_ops.ready())

    async def metrics(self) -> str:
        """The Prometheus metrics, as text."""
        return await self._send(_ops.metrics())

    # -- events ----------------------------------------------------------------------------------------------------

    def events(
        self,
        sid: str,
        *,
        since: int = 0,
        types: Sequence[str] | None = None,
        on_resume: ResumeHook | None = None,
    ) -> AsyncEventStream:
        """The session's events after ``since`` (glob ``types`` such as ``tool.*``), each once and in order across
        reconnects; the iteration ends when the session has closed. ``on_resume`` is told of each reconnect."""
        pos = stream_position(
            self.base_url,
            session_id=sid,
            start=since,
            types=types,
            reconnect_for_s=self.reconnect_for_s,
            on_resume=on_resume,
        )
        return AsyncEventStream(pos, self._headers)

    def media(
        self, sid: str, *, token: str | None = None, edge_id: str | None = None, connection: int | None = None
    ) -> MediaConnection:
        """The session's media connection, as its edge (``async with``): see :mod:`switchboard.client.media`.
        Authenticated with the client's API key (scope ``media:connect``), or with a session ``token`` in the URL.
        ``edge_id`` and ``connection``: the edge's random id and this attempt's number (1, 2, 3, ...)."""
        headers = {} if token else self._headers
        url = media_url(self.base_url, sid, token=token, edge_id=edge_id, connection=connection)
        return MediaConnection(url, headers)

    def all_events(
        self,
        *,
        cursor: int | Literal["now"] = 0,
        session_ids: Sequence[str] | None = None,
        types: Sequence[str] | None = None,
        on_resume: ResumeHook | None = None,
    ) -> AsyncEventStream:
        """Events of many sessions (all, or ``session_ids``), each carrying its ``cursor``; resumes from the last
        one across reconnects. ``cursor="now"`` starts at the live tail. It never ends by itself."""
        pos = stream_position(
            self.base_url,
            start=cursor,
            types=types,
            session_ids=session_ids,
            reconnect_for_s=self.reconnect_for_s,
            on_resume=on_resume,
        )
        return AsyncEventStream(pos, self._headers)
