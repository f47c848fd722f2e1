"""SessionHost: the live sessions of this process, wired to the store, the registry and the event hub."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from .demo import DEMO_SCRIPT
from .hub import EventHub
from .model_profiles import ModelProfiles
from .runtime.agent import AgentRegistry
from .runtime.chat import ChatContext, ChatItem, new_id, utcnow
from .runtime.events import Event, EventLog
from .runtime.llm import build_llm
from .runtime.playout import SimulatedPlayout
from .runtime.ports import EventSink
from .runtime.recovery import end_orphaned_calls, recover
from .runtime.session import AgentSession, SessionOptions
from .settings import Settings
from .store import SessionData, SessionExists, SessionRecord, Store

logger = logging.getLogger("switchboard.host")

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


class TooManySessions(Exception):
    pass


def session_options(config: dict[str, Any]) -> SessionOptions:
    opts: dict[str, Any] = {}
    for key in ("max_tool_steps", "preemptive_generation", "allow_interruptions"):
        if config.get(key) is not None:
            opts[key] = config[key]
    return SessionOptions(**opts)


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
        self.default_llms = dict(default_llms or {})  # agent name -> llm config used when a session gives none
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

    def _build(self, rec: SessionRecord, *, items: list[ChatItem] = (), last_seq: int = 0) -> AgentSession:  # type: ignore[assignment]
        agent = self.registry.create(rec.agent)
        default = self.default_llms.get(rec.config.get("agent") or rec.agent)
        if default is None and rec.config.get("agent") == "demo":
            default = DEMO_SCRIPT
        # a session's own llm is checked on every build, recovery included: a stored config never bypasses it
        llm = build_llm(self.models.for_session(rec.config.get("llm"), default))
        if rec.llm_state is not None:
            llm.load_state(rec.llm_state)
        wps = (rec.config.get("playout") or {}).get("words_per_second") or self.settings.words_per_second
        return AgentSession(
            session_id=rec.id,
            agent=agent,
            llm=llm,
            playout=SimulatedPlayout(float(wps)),
            store=self.store.chat_store(),
            events=self._sink,
            options=session_options(rec.config),
            items=items,
            last_seq=last_seq,
        )

    async def create(self, config: dict[str, Any], metadata: dict[str, Any]) -> tuple[SessionRecord, bool]:
        """Create and start a session. Returns (record, created); the same id with the same body is a no-op."""
        sid = config.get("id") or new_id("sess")
        config = {**config, "id": sid}
        async with self._create_lock:
            existing = self.sessions.get(sid)
            rec = await self.store.get_session(sid) if existing is None else None
            if existing is not None or rec is not None:
                found = rec or await self.store.get_session(sid)
                assert found is not None
                if found.config == config and found.metadata == metadata:
                    return found, False
                raise SessionConflict(sid)
            if len(self.sessions) >= self.settings.max_sessions:
                raise TooManySessions(f"this server hosts at most {self.settings.max_sessions} live sessions")
            now = utcnow()
            rec = SessionRecord(
                id=sid,
                agent=config["agent"],
                state="initializing",
                config=config,
                metadata=metadata,
                llm_state=None,
                current_speech_id=None,
                created_at=now,
                updated_at=now,
            )
            session = self._build(rec)  # validates agent and llm before anything is stored
            try:
                await self.store.create_session(rec)
            except SessionExists:
                raise SessionConflict(sid) from None
            self.sessions[sid] = session
            self.records[sid] = rec
        await session.start()
        return rec, True

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
        await self.store.mark_session(rec.id, "failed")
        await log.emit("session.failed", reason=reason, interrupted_calls=interrupted, **extra)
        self.failed.append(rec.id)

    async def aclose(self) -> None:
        """Service shutdown: suspend every session (they stay live and are recovered on the next start)."""
        sessions = list(self.sessions.values())
        await asyncio.gather(*(s.suspend() for s in sessions), return_exceptions=True)
        self.sessions.clear()
        self.records.clear()
