"""SessionHost: the live sessions of this process, wired to the store, the registry and the event hub."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..integrations.model_profiles import ModelProfiles
from ..runtime.agent import AgentRegistry
from ..runtime.chat import ChatContext, ChatItem, new_id, utcnow
from ..runtime.event_types import SessionFailed
from ..runtime.events import Event, EventLog
from ..runtime.llm import LLM, build_llm
from ..runtime.playout import SimulatedPlayout
from ..runtime.ports import EventSink
from ..runtime.recovery import end_orphaned_calls, recover
from ..runtime.session import AgentSession, SessionOptions
from ..runtime.speech import SpeechInfo
from ..runtime.status import SessionStatus
from ..runtime.tools import ToolCallInfo, ToolStatus
from ..store import SessionData, SessionExists, SessionRecord, Store
from .hub import EventHub
from .settings import Settings

logger = logging.getLogger("switchboard.control.host")

# Sessions recovered at once. Each one awaits its first commits; as many as the store writer puts in one batch
# (its default batch_max) share a group commit, so 1,000 sessions take a handful of transactions, not hundreds.
RECOVERY_CONCURRENCY = 256


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Recovery creates millions of objects that all stay alive (every chat item of every live session); the
    cyclic GC would scan them again and again as they pile up (measured: a third of the recovery time of 1,000
    sessions x 100 items). Recovery runs before the service serves, so the GC is simply paused meanwhile."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class SessionConflict(Exception):
    """A session with this id exists with a different configuration."""

    def __init__(self, session_id: str) -> None:
        super().__init__(session_id)
        self.session_id = session_id


class TooManySessions(Exception):
    pass


class InvalidSessionConfig(ValueError):
    """The session's model or options cannot be built (an unknown provider, a bad key...)."""


class PlayoutSettings(BaseModel):
    model_config = ConfigDict(frozen=True)

    words_per_second: float | None = None


class SessionConfig(BaseModel):
    """How a session runs, as it was created; stored as the session's ``config`` (JSON) and read back on recovery.

    ``agent`` is the agent the session started with (a handoff changes the running agent, not this).
    ``llm`` is opaque here: the provider that ``build_llm`` picks validates it.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str | None = None
    agent: str
    llm: dict[str, Any] | None = None
    playout: PlayoutSettings | None = None
    preemptive_generation: bool | None = None
    allow_interruptions: bool | None = None
    max_tool_steps: int | None = None

    @classmethod
    def from_record(cls, rec: SessionRecord) -> SessionConfig:
        """The configuration of a stored session (rows written without an ``agent`` in it run ``rec.agent``)."""
        return cls.model_validate({"agent": rec.agent, **rec.config, "id": rec.id})

    def stored(self) -> dict[str, Any]:
        """The JSON kept in the session row: only what was given, so equal bodies give equal rows."""
        return self.model_dump(mode="json", exclude_none=True)

    def options(self) -> SessionOptions:
        given = {
            "max_tool_steps": self.max_tool_steps,
            "preemptive_generation": self.preemptive_generation,
            "allow_interruptions": self.allow_interruptions,
        }
        return SessionOptions(**{key: value for key, value in given.items() if value is not None})


@dataclass(frozen=True, slots=True)
class SessionView:
    """One session as this process knows it: its stored record, and the live session when this process runs it.

    Reads answer from the live session when there is one, else from the store.
    """

    record: SessionRecord
    live: AgentSession | None
    store: Store

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def state(self) -> str:
        return self.live.state if self.live is not None else self.record.state

    @property
    def ended(self) -> bool:
        """Closed or failed for good: its last event is durable and nothing follows it."""
        return self.live is None and SessionStatus(self.record.state).ended

    async def chat(self) -> list[ChatItem]:
        if self.live is not None:
            return self.live.chat.items
        return await self.store.chat_items(self.id)

    async def speech(self, speech_id: str) -> SpeechInfo | None:
        handle = self.live.speech(speech_id) if self.live is not None else None
        if handle is not None:
            return handle.info()
        return await self.store.speech(self.id, speech_id)

    async def tool_calls(self, status: ToolStatus | None = None) -> list[ToolCallInfo]:
        """The session's tool calls, by start time."""
        if self.live is None:
            infos = await self.store.tool_calls(self.id, status)
        else:
            infos = self.live.tool_calls(status)
            if not self.live.remembers_every_tool_call:  # older ended calls are only in the store now
                known = {i.call_id for i in infos}
                infos += [i for i in await self.store.tool_calls(self.id, status) if i.call_id not in known]
        return sorted(infos, key=lambda i: i.started_at)

    async def tool_call(self, call_id: str) -> ToolCallInfo | None:
        info = self.live.tool_call(call_id) if self.live is not None else None
        return info if info is not None else await self.store.tool_call(self.id, call_id)


class SessionHost:
    def __init__(
        self,
        *,
        store: Store,
        registry: AgentRegistry,
        hub: EventHub,
        settings: Settings,
        on_event: Callable[[Event], None] | None = None,
        default_llms: Mapping[str, dict[str, Any]] | None = None,
        models: ModelProfiles | None = None,
    ) -> None:
        self.store = store
        self.registry = registry
        self.hub = hub
        self.settings = settings
        # agent name -> the llm config a session of that agent uses when it gives none (the built-in agents' and the
        # agents file's)
        self.default_llms = dict(default_llms or {})
        self.models = models or ModelProfiles()
        self.sessions: dict[str, AgentSession] = {}
        self.records: dict[str, SessionRecord] = {}
        self._on_event = on_event
        self._sink: EventSink = store.event_sink(on_durable=self._on_durable)
        self._create_lock = asyncio.Lock()
        self.recovered: list[str] = []
        self.failed: list[str] = []

    def _on_durable(self, events: list[Event]) -> None:
        pairs = [(e.cursor or 0, e) for e in events]
        self.hub.publish(pairs)
        if self._on_event is not None:
            for _, event in pairs:
                self._on_event(event)

    # -- building sessions ----------------------------------------------------------------------------------

    def _llm(self, config: SessionConfig) -> LLM:
        """The session's model: its own ``llm`` (a model profile, or a self-contained provider), else the default of
        the agent it started with. A session's own llm is checked on every build, recovery included: a stored config
        never bypasses it."""
        return build_llm(self.models.for_session(config.llm, self.default_llms.get(config.agent)))

    def _build(self, rec: SessionRecord, *, items: Sequence[ChatItem] = (), last_seq: int = 0) -> AgentSession:
        config = SessionConfig.from_record(rec)
        agent = self.registry.create(rec.agent)
        llm = self._llm(config)
        if rec.llm_state is not None:
            llm.load_state(rec.llm_state)
        wps = (config.playout.words_per_second if config.playout else None) or self.settings.words_per_second
        return AgentSession(
            session_id=rec.id,
            agent=agent,
            llm=llm,
            playout=SimulatedPlayout(float(wps)),
            store=self.store.chat_store(),
            events=self._sink,
            options=config.options().model_copy(
                update={"max_tool_calls_per_turn": self.settings.max_tool_calls_per_turn}
            ),
            items=items,
            last_seq=last_seq,
        )

    async def create(self, config: SessionConfig, metadata: dict[str, Any]) -> tuple[SessionView, bool]:
        """Create and start a session. Returns (session, created); the same id with the same body is a no-op.

        Raises ``UnknownAgent``, ``InvalidSessionConfig``, ``SessionConflict`` or ``TooManySessions``.
        """
        sid = config.id or new_id("sess")
        stored = config.model_copy(update={"id": sid}).stored()
        async with self._create_lock:
            existing = self.sessions.get(sid)
            rec = await self.store.get_session(sid) if existing is None else None
            if existing is not None or rec is not None:
                found = rec or await self.store.get_session(sid)
                assert found is not None
                if found.config == stored and found.metadata == metadata:
                    return SessionView(found, existing, self.store), False
                raise SessionConflict(sid)
            if len(self.sessions) >= self.settings.max_sessions:
                raise TooManySessions(f"this server hosts at most {self.settings.max_sessions} live sessions")
            now = utcnow()
            rec = SessionRecord(
                id=sid,
                agent=config.agent,
                state=SessionStatus.INITIALIZING,
                config=stored,
                metadata=metadata,
                llm_state=None,
                current_speech_id=None,
                created_at=now,
                updated_at=now,
            )
            try:
                session = self._build(rec)  # validates agent and llm before anything is stored
            except ValueError as err:
                raise InvalidSessionConfig(str(err)) from err
            try:
                await self.store.create_session(rec)
            except SessionExists:
                raise SessionConflict(sid) from None
            self.sessions[sid] = session
            self.records[sid] = rec
        await session.start()
        return SessionView(rec, session, self.store), True

    async def find(self, sid: str) -> SessionView | None:
        """The session, live or stored; None when it never existed. Only a session that is not live costs a read."""
        live = self.sessions.get(sid)
        if live is not None:
            return SessionView(self.records[sid], live, self.store)
        rec = await self.store.get_session(sid)
        return SessionView(rec, None, self.store) if rec is not None else None

    async def list_sessions(
        self, *, state: str | None = None, cursor: str | None = None, limit: int = 50
    ) -> tuple[list[SessionView], str | None]:
        """Sessions newest first, a page at a time (``Store.list_sessions``), each with its live session if any."""
        records, next_cursor = await self.store.list_sessions(state=state, cursor=cursor, limit=limit)
        return [SessionView(rec, self.sessions.get(rec.id), self.store) for rec in records], next_cursor

    def live(self, sid: str) -> AgentSession | None:
        return self.sessions.get(sid)

    async def close(self, sid: str) -> bool:
        session = self.sessions.get(sid)
        if session is None:
            return False
        try:
            await session.aclose()
        finally:
            self.sessions.pop(sid, None)
            self.records.pop(sid, None)
        return True

    # -- recovery and shutdown ------------------------------------------------------------------------------

    async def recover_all(self) -> None:
        """Recover every session that was live (on start, before serving): all of them read in a few bulk queries,
        then each rebuilt and settled (``runtime.recovery.recover``); one that cannot be rebuilt is marked failed."""
        records = await self.store.live_sessions()
        if not records:
            return
        sem = asyncio.Semaphore(RECOVERY_CONCURRENCY)
        with _gc_paused():
            loaded = await self.store.load_sessions_bulk([rec.id for rec in records])

            async def one(rec: SessionRecord) -> None:
                async with sem:
                    await self._recover(rec, loaded.pop(rec.id))

            await asyncio.gather(*(one(rec) for rec in records))
        logger.info("recovered %d session(s); %d failed", len(self.recovered), len(self.failed))

    async def _recover(self, rec: SessionRecord, data: SessionData) -> None:
        if rec.agent not in self.registry:
            logger.error("session %s: agent %r no longer exists; marking it failed", rec.id, rec.agent)
            await self._fail(rec, data, reason=f"unknown agent {rec.agent!r}", agent=rec.agent)
            return
        try:
            session = self._build(rec, items=data.items, last_seq=data.last_seq)
        except Exception as err:  # whatever the agent's factory raises: this session fails, the others start
            logger.exception("session %s cannot be recovered", rec.id)
            await self._fail(rec, data, reason=str(err) or type(err).__name__)
            return
        self.sessions[rec.id] = session
        self.records[rec.id] = rec
        await recover(session, tool_calls=data.tool_calls, speeches=data.speeches)
        self.recovered.append(rec.id)

    async def _fail(self, rec: SessionRecord, data: SessionData, *, reason: str, **extra: Any) -> None:
        """Mark a session that cannot be recovered ``failed``; the calls it left running still end (I5)."""
        log = EventLog(rec.id, self._sink, last_seq=data.last_seq)
        interrupted = await end_orphaned_calls(
            rec.id, tool_calls=data.tool_calls, chat=ChatContext(data.items), store=self.store.chat_store(), events=log
        )
        await self.store.mark_session(rec.id, SessionStatus.FAILED)
        await log.emit(SessionFailed(reason=reason, interrupted_calls=interrupted, **extra))
        self.failed.append(rec.id)

    async def aclose(self) -> None:
        """Service shutdown: suspend every session (they stay live and are recovered on the next start)."""
        sessions = list(self.sessions.values())
        await asyncio.gather(*(s.suspend() for s in sessions), return_exceptions=True)
        self.sessions.clear()
        self.records.clear()
