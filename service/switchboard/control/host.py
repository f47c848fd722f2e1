"""SessionHost: the live sessions of this process, wired to the store, the registry and the event hub."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from ..integrations.model_profiles import ModelProfiles
from ..runtime.agent import AgentRegistry
from ..runtime.chat import ChatContext, ChatItem, new_id, utcnow
from ..runtime.event_types import SessionFailed
from ..runtime.events import Event, EventLog
from ..runtime.llm import LLM, MissingCredential, StandInLLM, build_llm, prepare_llm
from ..runtime.media import EdgePlayout
from ..runtime.playout import SimulatedPlayout
from ..runtime.ports import ChatStore, EventSink, Receipt
from ..runtime.recovery import end_orphaned_calls, recover, report_missing
from ..runtime.session import AgentSession
from ..runtime.status import SessionStatus
from ..runtime.tools import FunctionTool
from ..store import QuotaFull, SessionData, SessionExists, SessionRecord, Store, is_transient
from .alerts import AlertEngine
from .attention import ATTENTION_EVENTS, KEEP_FAILED, AttentionReason, AttentionTracker, Thresholds
from .catalog import AgentCatalog, ModelSummary, summarize_model
from .cluster.ownership import NodeLease
from .hub import EventHub
from .model_meter import MeteredLLM, ModelObserver, model_label
from .pending import PendingCreates
from .session_config import SessionConfig, SharedOptions
from .session_view import SessionView
from .settings import Settings

logger = logging.getLogger("switchboard.control.host")

# Sessions recovered at once. Each one awaits its first commits; as many as the store writer puts in one batch
# (its default batch_max) share a group commit, so 1,000 sessions take a handful of transactions, not hundreds.
RECOVERY_CONCURRENCY = 256
# a session adopted from another node brings this many of its latest events of the kinds that say why it needs an
# operator (an input waiting for its answer, a failed model or tool): enough for the turn under way
ATTENTION_HISTORY = 32
FAILED_LISTED_S = 24 * 3600.0  # a session that failed is listed as needing attention this long
FENCED_REMEMBERED = 1000


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Recovery creates millions of objects that all stay alive (every chat item of every live session); the
    cyclic GC would scan them again and again as they pile up (measured: a third of the recovery time of 1,000
    sessions x 100 items). Recovery runs before the service serves, so the GC is simply paused meanwhile.

    What is frozen stays frozen (``gc.freeze``: the server freezes what exists when it starts, to keep it out of every
    later full collection): moving what recovery made to the oldest generation with ``gc.freeze()`` then
    ``gc.unfreeze()`` saved a tenth of a large recovery's CPU, but the unfreeze also thawed everything frozen before,
    at every recovery and adoption round, and every full collection after it scanned the whole process again."""
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


class SessionQuotaExceeded(TooManySessions):
    """The caller already runs as many live sessions as one credential may."""


class InvalidSessionConfig(ValueError):
    """The session's model or options cannot be built (an unknown provider, a bad key...)."""


class ModelNotConfigured(InvalidSessionConfig):
    """The session's model needs something the service's configuration lacks (an API key's variable)."""


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
        lease: NodeLease | None = None,
        on_durable: Callable[[list[Event]], None] | None = None,
        model_observer: ModelObserver | None = None,
        wrap_sink: Callable[[EventSink], EventSink] | None = None,
        wrap_llm: Callable[[str, LLM, dict[str, Any] | None], LLM] | None = None,
    ) -> None:
        self.store = store
        # this process as a node: the sessions it owns, checked by every write (None: unfenced, as in tests)
        self.lease = lease
        if lease is not None:
            lease.fence.on_fenced = self._on_lost
        self.registry = registry
        self.hub = hub
        self.settings = settings
        # agent name -> the llm config a session of that agent uses when it gives none (the built-in agents' and the
        # agents file's)
        self.default_llms = dict(default_llms or {})
        self.models = models or ModelProfiles()
        self.model_observer = model_observer
        self.catalog = AgentCatalog(registry, self.models, self.default_llms)
        self.sessions: dict[str, AgentSession] = {}
        self.records: dict[str, SessionRecord] = {}
        self._on_event = on_event
        self._also_on_durable = on_durable  # e.g. the cluster's fan-out to the other nodes
        self.attention = AttentionTracker(
            Thresholds(
                long_tool_s=settings.attention_long_tool_s,
                stall_s=settings.attention_stall_s,
                silence_s=settings.attention_silence_s,
                operator_quiet_s=settings.attention_operator_quiet_s,
            )
        )
        self.alerts: AlertEngine | None = None  # the reasons delivered to webhook sinks, when some are configured
        self._wrap_sink = wrap_sink  # tracing sees each event as it is emitted
        self._wrap_llm = wrap_llm  # and each generation's usage
        # one of each per epoch, shared by the sessions of that epoch: neither keeps anything of a session's own
        self._sinks: dict[int | None, EventSink] = {}
        self._chat_stores: dict[int | None, ChatStore] = {}
        self._creating = PendingCreates()
        self._options = SharedOptions(settings)
        self._agent_models: dict[str, tuple[dict[str, Any] | None, Callable[[], LLM]]] = {}  # ``_agent_model``
        self._agent_summaries: dict[str, tuple[ModelSummary | None]] = {}  # ``model_summary``
        # when each live session last reported anything (its events), for closing idle ones; a clock tests can move
        self.clock: Callable[[], float] = time.monotonic
        self._active_at: dict[str, float] = {}
        self.recovered: list[str] = []
        self._warned_handoffs: set[str] = set()
        self.failed: list[str] = []
        self.fenced: dict[str, str] = {}  # session id -> why this node lost it (the latest FENCED_REMEMBERED)
        self.adopted = 0
        self._unrecovered: set[str] = set()  # claimed, recovery failed: tried again on the next round
        self._uncertain: set[str] = set()  # created, but whether the row landed is unknown: settled on the next round
        self._adopt_ev = asyncio.Event()  # another node handed sessions over: adopt now, not at the next round
        # held by a recovery round: a drain hands over what a round under way adds too (it waits for the round)
        self._round_lock = asyncio.Lock()
        self._drops: set[asyncio.Task[None]] = set()
        self._starts: set[asyncio.Task[None]] = set()  # session starts, run on when their create is cut off

    @property
    def node_id(self) -> str | None:
        return self.lease.node_id if self.lease is not None else None

    def _epoch(self, rec: SessionRecord) -> int | None:
        """The fencing token of what is written for ``rec`` here: the epoch of the claim it was created or adopted
        under (None without a lease: nothing is fenced)."""
        return rec.owner_epoch if self.lease is not None else None

    def _holds(self, rec: SessionRecord) -> bool:
        """This node still holds ``rec`` at the epoch it was claimed under (a claim made since is another
        incarnation's)."""
        return self.lease is None or self.lease.fence.epochs.get(rec.id) == rec.owner_epoch

    def _chat_store_for(self, epoch: int | None) -> ChatStore:
        chat = self._chat_stores.get(epoch)
        if chat is None:
            chat = self._chat_stores[epoch] = self.store.chat_store(epoch)
        return chat

    def _sink_for(self, epoch: int | None) -> EventSink:
        sink = self._sinks.get(epoch)
        if sink is None:
            sink = self.store.event_sink(on_durable=self._on_durable, epoch=epoch)
            if self._wrap_sink is not None:
                sink = self._wrap_sink(sink)
            self._sinks[epoch] = sink
        return sink

    def _on_lost(self, sid: str, why: str) -> None:
        """The session is another node's now (or nobody's): stop running it here at once, without waiting for its
        tools (nothing it does can be written any more); reads of it answer from the store from now on."""
        session = self.sessions.pop(sid, None)
        self.records.pop(sid, None)
        self._active_at.pop(sid, None)
        self.fenced[sid] = why
        while len(self.fenced) > FENCED_REMEMBERED:
            del self.fenced[next(iter(self.fenced))]
        if session is not None:
            task = asyncio.create_task(session.suspend(tool_grace=False), name=f"fenced:{sid}")
            self._drops.add(task)
            task.add_done_callback(self._drops.discard)

    def _on_durable(self, events: list[Event]) -> None:
        pairs = [(e.cursor or 0, e) for e in events]
        now = self.clock()
        for event in events:
            if event.session_id in self.sessions:  # live here: a closed or failed one has no clock to keep
                self._active_at[event.session_id] = now
            self.attention.observe(event, self.sessions.get(event.session_id))
            if event.type == "agent.handoff":
                self._check_handoff(event)
        self.hub.publish(pairs)
        if self._also_on_durable is not None:
            self._also_on_durable(events)
        if self._on_event is not None:
            for _, event in pairs:
                self._on_event(event)

    def _first_audio_ms(self, config: SessionConfig) -> int:
        chosen = config.playout.first_audio_ms if config.playout else None
        return self.settings.first_audio_ms if chosen is None else chosen

    def _check_handoff(self, event: Event) -> None:
        target = event.data.get("to_agent")
        if target in self.registry or target in self._warned_handoffs:
            return
        self._warned_handoffs.add(str(target))
        logger.warning(
            "session %s: handed off to agent %r, which is not registered: the session works until the service "
            "restarts, then it cannot be recovered; register it (SWITCHBOARD_AGENTS) under that name",
            event.session_id,
            target,
            extra={"session_id": event.session_id},
        )

    # -- building sessions ----------------------------------------------------------------------------------

    def _llm(self, session_id: str, config: SessionConfig) -> LLM:
        """The session's model: its own ``llm`` (a model profile, or a self-contained provider), else the default of
        the agent it started with, else the stand-in (it runs the tool calls a user writes only where a session may
        bring a script of its own: both pick tool calls). A session's own llm is checked on every build, recovery
        included: a stored config never bypasses it."""
        if config.llm is None:  # its agent's default
            resolved, make = self._agent_model(config.agent)
            llm = make()
        else:
            resolved = self.models.for_session(config.llm, self.default_llms.get(config.agent))
            llm = build_llm(resolved) if resolved is not None else self._stand_in()
        if self._wrap_llm is not None:
            llm = self._wrap_llm(session_id, llm, resolved)
        if self.model_observer is None:
            return llm
        return MeteredLLM(llm, model_label(resolved), self.model_observer)

    def _agent_model(self, agent: str) -> tuple[dict[str, Any] | None, Callable[[], LLM]]:
        """The model configuration of ``agent``'s sessions that bring none, and how to build one: resolved and
        prepared (a script parsed) once per agent, not per session (a create spent more on it than on the rest of
        the session). Not kept when it fails: the next session fails the same way, and says why."""
        found = self._agent_models.get(agent)
        if found is None:
            resolved = self.models.for_session(None, self.default_llms.get(agent))
            make = prepare_llm(resolved) if resolved is not None else self._stand_in
            found = self._agent_models[agent] = (resolved, make)
        return found

    def _stand_in(self) -> LLM:
        return StandInLLM(calls_tools=self.models.sessions_may_script)

    def _build(self, rec: SessionRecord, *, items: Sequence[ChatItem] = (), last_seq: int = 0) -> AgentSession:
        """One incarnation of ``rec`` on this node, with its chat ``items`` (ordered, as the store reads them back):
        everything it writes carries ``rec.owner_epoch``, the epoch it was created or adopted at, so none of it lands
        once the node lost that claim (even if it claimed the session again since: the new incarnation's writes carry
        the new epoch)."""
        config = SessionConfig.from_record(rec)
        epoch = self._epoch(rec)
        agent = self.registry.create(rec.agent)
        llm = self._llm(rec.id, config)
        if rec.llm_state is not None:
            llm.load_state(rec.llm_state)
        wps = (config.playout.words_per_second if config.playout else None) or self.settings.words_per_second
        return AgentSession(
            session_id=rec.id,
            agent=agent,
            llm=llm,
            # through a media edge while one is connected (WS /v1/sessions/{sid}/media), else the simulated clock
            playout=EdgePlayout(SimulatedPlayout(float(wps), first_audio_s=self._first_audio_ms(config) / 1000)),
            store=self._chat_store_for(epoch),
            events=self._sink_for(epoch),
            options=self._options(config),  # one object per distinct set of options, shared
            items=ChatContext(items, ordered=True),  # as the store reads a chat back: in the order of the view
            last_seq=last_seq,
            entered=rec.entered,
            takeover=rec.takeover,
        )

    async def create(
        self, config: SessionConfig, metadata: dict[str, Any], receipt: Receipt[SessionRecord] | None = None
    ) -> tuple[SessionView, bool]:
        """Create and start a session. Returns (session, created); the same id with the same body is a no-op, also
        when another node creates it at the same moment. ``receipt`` (an idempotent create's) is completed in the
        transaction that inserts the session.

        Raises ``UnknownAgent``, ``InvalidSessionConfig``, ``SessionConflict`` or ``TooManySessions``.
        """
        sid = config.id or new_id("sess")
        stored = config.model_copy(update={"id": sid}).stored()
        await self._creating.wait(sid)  # the same id created at the same moment: the first one's outcome first
        existing = self.sessions.get(sid)
        if existing is not None:
            return self._created_before(sid, await self.store.get_session(sid), existing, stored, metadata)
        self._check_room(config.owner)
        with self._creating.hold(sid, config.owner):
            # a stored session of this id (closed, or another node's) is found by the insert: no read before it
            session, rec = self._new_session(sid, config, stored, metadata)
            try:
                done = receipt.complete(rec) if receipt is not None else None
                await self.store.create_session(rec, owner_quota=self._shared_quota(config.owner), receipt=done)
            except SessionExists:  # stored before, or another node inserted it first: the same create is no conflict
                return self._created_before(sid, await self.store.get_session(sid), None, stored, metadata)
            except QuotaFull:
                raise self._quota_exceeded() from None
            except BaseException:
                self._uncertain.add(sid)
                raise
            if self.lease is not None:
                self.lease.claim_new(sid)
            self.sessions[sid] = session
            self.records[sid] = rec
        # a task the host owns: a create cut off (its deadline, its client gone) while the agent's MCP servers are
        # listed still ends with the session started (or closed), never stored as initializing for ever
        start = asyncio.create_task(session.start(), name=f"start:{sid}")
        self._starts.add(start)
        start.add_done_callback(self._starts.discard)
        await asyncio.shield(start)
        return SessionView(rec, session, self.store), True

    def _check_room(self, owner: str | None) -> None:
        """This node may take one more session (its creates under way counted as live)."""
        if self.lease is not None:
            self.lease.check_serving()
        if len(self.sessions) + len(self._creating) >= self.settings.max_sessions:
            raise TooManySessions(f"this server hosts at most {self.settings.max_sessions} live sessions")
        if self._shared_quota(owner) is None:
            self._check_quota(owner)

    def _new_session(
        self, sid: str, config: SessionConfig, stored: dict[str, Any], metadata: dict[str, Any]
    ) -> tuple[AgentSession, SessionRecord]:
        """The record of a new session and its live session, built (agent and llm validated) before anything is
        stored."""
        now = utcnow()
        rec = SessionRecord(
            id=sid,
            agent=config.agent,
            state=SessionStatus.INITIALIZING,
            config=stored,
            metadata=metadata,
            llm_state=None,
            current_speech_id=None,
            entered=False,  # its agent enters when it starts (``AgentSession.start``), or where it runs next
            created_at=now,
            updated_at=now,
            owner_node=self.node_id,
            owner_epoch=1 if self.lease is not None else 0,
        )
        try:
            return self._build(rec), rec
        except MissingCredential as err:
            raise ModelNotConfigured(str(err)) from err
        except ValueError as err:
            raise InvalidSessionConfig(str(err)) from err

    def _created_before(
        self,
        sid: str,
        found: SessionRecord | None,
        live: AgentSession | None,
        stored: dict[str, Any],
        metadata: dict[str, Any],
    ) -> tuple[SessionView, bool]:
        """A create of an id that exists: answered with that session when the body is the same, else a conflict."""
        if found is None or found.config != stored or found.metadata != metadata:
            raise SessionConflict(sid)
        return SessionView(found, live, self.store), False

    def _shared_quota(self, owner: str | None) -> int | None:
        """Cluster mode: the quota of ``owner`` is counted in the database, where every node's sessions are, as the
        session is inserted (``Store.create_session``). On a single node this process runs every live session, so it
        counts its own, without a round trip."""
        if owner is None or not self.settings.cluster_mode:
            return None
        return self.settings.session_quota

    def _check_quota(self, owner: str | None) -> None:
        """One credential cannot fill the server: it runs at most ``session_quota`` live sessions at once."""
        if owner is None:
            return
        live = sum(1 for rec in self.records.values() if rec.config.get("owner") == owner)
        if live + self._creating.of_owner(owner) >= self.settings.session_quota:
            raise self._quota_exceeded()

    def _quota_exceeded(self) -> SessionQuotaExceeded:
        quota = self.settings.session_quota
        return SessionQuotaExceeded(f"one API key runs at most {quota} live sessions at once; close some first")

    async def close_idle(self, idle_timeout_s: float) -> list[str]:
        """Close every session that has been idle (``AgentSession.dormant``, no event) for ``idle_timeout_s``; each
        one's ``session.closed`` says ``reason: idle``. Returns their ids."""
        now = self.clock()
        stale = [
            sid
            for sid, session in self.sessions.items()
            if session.dormant and now - self._active_at.setdefault(sid, now) >= idle_timeout_s
        ]
        for sid in stale:
            logger.info("closing session %s: idle for %.0f s", sid, idle_timeout_s, extra={"session_id": sid})
        await asyncio.gather(*(self.close(sid, reason="idle") for sid in stale))
        return stale

    async def find(self, sid: str) -> SessionView | None:
        """The session, live or stored; None when it never existed. Only a session that is not live costs a read."""
        live = self.sessions.get(sid)
        if live is not None:
            return SessionView(self.records[sid], live, self.store)
        rec = await self.store.get_session(sid)
        return SessionView(rec, None, self.store) if rec is not None else None

    async def list_sessions(
        self, *, state: str | None = None, agent: str | None = None, cursor: str | None = None, limit: int = 50
    ) -> tuple[list[SessionView], str | None]:
        """Sessions newest first, a page at a time (``Store.list_sessions``), each with its live session if any."""
        records, next_cursor = await self.store.list_sessions(state=state, agent=agent, cursor=cursor, limit=limit)
        return [SessionView(rec, self.sessions.get(rec.id), self.store) for rec in records], next_cursor

    def model_summary(self, rec: SessionRecord) -> ModelSummary | None:
        """The provider and model name a session uses, and its profile: nothing secret (no URL, no variable)."""
        agent = rec.config.get("agent", rec.agent)
        if rec.config.get("llm") is None and isinstance(agent, str):  # its agent's default: one summary per agent
            found = self._agent_summaries.get(agent)
            if found is None:
                summary = summarize_model(self.models, None, self.default_llms.get(agent))
                found = self._agent_summaries[agent] = (summary,)
            return found[0]
        config = SessionConfig.from_record(rec)
        return summarize_model(self.models, config.llm, self.default_llms.get(config.agent))

    def attention_reasons(self, view: SessionView) -> list[AttentionReason]:
        """Why ``view`` needs an operator now (empty: it does not)."""
        return self.attention.reasons(view.id, view.live, store_unavailable=self.store.writer.unavailable)

    async def needing_attention(self, *, agent: str | None = None) -> list[SessionView]:
        """The sessions that need an operator as this node knows them: its live ones with a reason (the reasons
        of one adopted from another node come from its durable log), and those that failed in the last
        ``FAILED_LISTED_S`` on any node (read from the database); the longest waiting first."""
        views = [SessionView(self.records[sid], live, self.store) for sid, live in list(self.sessions.items())]
        since = utcnow() - timedelta(seconds=FAILED_LISTED_S)
        for rec, failure in await self.store.failed_sessions(since=since, limit=KEEP_FAILED):
            if rec.id not in self.sessions:
                if failure is not None:
                    self.attention.observe(failure, None)
                views.append(SessionView(rec, None, self.store))
        found = [(reasons, v) for v in views if (reasons := self.attention_reasons(v))]
        found = [
            (r, v)
            for r, v in found
            if agent is None or v.record.agent == agent or (v.live and v.live.agent.name == agent)
        ]
        found.sort(key=lambda pair: (pair[0][0].since, pair[1].id))  # a total order: ties are cut one way
        return [v for _, v in found]

    def live(self, sid: str) -> AgentSession | None:
        return self.sessions.get(sid)

    async def close(self, sid: str, *, reason: str | None = None) -> bool:
        session = self.sessions.get(sid)
        if session is None:
            return False
        try:
            await session.aclose(reason=reason)
        finally:
            if self.sessions.get(sid) is session:
                self.sessions.pop(sid, None)
                self.records.pop(sid, None)
                self._active_at.pop(sid, None)
                if self.lease is not None:
                    self.lease.fence.release(sid)
        return True

    # -- recovery and shutdown ------------------------------------------------------------------------------

    async def recover_all(self, *, claim: bool = True) -> None:
        """Recover every session that was live (on start, before serving): all of them read in a few bulk queries,
        then each rebuilt and settled (``runtime.recovery.recover``); one that cannot be rebuilt is marked failed.

        A node recovers the sessions it claims (those no live node owns: ``NodeLease.claim_orphans``) and those it
        still owns whose recovery failed on an earlier round (``claim=False``: only those). A session whose recovery
        fails (a write error, lost meanwhile) does not stop the others: it is logged, and tried again if still owned."""
        async with self._round_lock:
            await self._recover_round(claim)

    async def _recover_round(self, claim: bool) -> None:
        await self._settle_uncertain()
        retry, self._unrecovered = self._unrecovered, set()
        if self.lease is not None:
            retry = {sid for sid in retry if self.lease.fence.owns(sid)}
        try:
            records = await self._records_to_recover(claim, retry)
            if not records:
                return
            with _gc_paused():
                loaded = await self.store.load_sessions_bulk(
                    [rec.id for rec in records], recent_types=ATTENTION_EVENTS, recent_limit=ATTENTION_HISTORY
                )
        except BaseException:
            self._unrecovered |= retry  # claimed (or kept) but not recovered: the next round tries again
            raise
        sem = asyncio.Semaphore(RECOVERY_CONCURRENCY)

        async def one(rec: SessionRecord) -> None:
            async with sem:
                await self._recover_or_retry(rec, loaded.pop(rec.id))

        with _gc_paused():
            await asyncio.gather(*(one(rec) for rec in records))
        outcomes = (len(self.recovered), len(self.failed), len(self._unrecovered))
        logger.info("recovered %d session(s); %d failed, %d to retry", *outcomes)

    async def _settle_uncertain(self) -> None:
        """Creates that failed while their row may have been committed (the connection lost, or the caller gone, in
        the commit): a row that landed is this node's session, recovered with the others of the round, so it neither
        lingers unrun nor holds a place of its key's quota for nothing; one that did not land is forgotten. Each held
        as a create of its id (``PendingCreates``): a create of the same id meanwhile finds the row, or inserts it
        itself."""
        for sid in sorted(self._uncertain):
            await self._creating.wait(sid)
            with self._creating.hold(sid, None):
                rec = None if sid in self.sessions else await self.store.get_session(sid)
                self._uncertain.discard(sid)
                if rec is not None and SessionStatus(rec.state).live and self._inserted_here(rec):
                    if self.lease is not None:
                        self.lease.claim_new(sid)
                    self._unrecovered.add(sid)

    def _inserted_here(self, rec: SessionRecord) -> bool:
        """Still as this node inserted it: no other node took it over since."""
        return rec.owner_node == self.node_id and (self.lease is None or rec.owner_epoch == 1)

    async def _records_to_recover(self, claim: bool, retry: set[str]) -> list[SessionRecord]:
        """The sessions of this round, each with the epoch of the claim it is recovered under (``owner_epoch``);
        ``retry`` gains those claimed now (a failure past this point retries them)."""
        if self.lease is None:
            return await self.store.live_sessions(ids=sorted(retry) if not claim else None)
        if claim:
            claimed = await self.lease.claim_orphans()
            retry |= set(claimed)
            self.adopted += len(claimed)
        held = {sid: epoch for sid in retry if (epoch := self.lease.fence.epochs.get(sid)) is not None}
        found = await self.store.live_sessions(ids=sorted(held)) if held else []
        update = {"owner_node": self.lease.node_id}
        return [rec.model_copy(update={**update, "owner_epoch": held[rec.id]}) for rec in found]

    async def _recover_or_retry(self, rec: SessionRecord, data: SessionData) -> None:
        sid = rec.id
        try:
            if not self._holds(rec):
                logger.warning("session %s: lost before it was recovered here; not recovering it", sid)
                return
            await self._recover(rec, data)
        except Exception as err:  # this session only: the others of the round carry on
            if not self._holds(rec):
                logger.warning("session %s: lost while being recovered here (%r)", sid, err, extra={"session_id": sid})
                return
            self._unrecovered.add(sid)
            logger.error("session %s: recovery failed; retry next round", sid, exc_info=err, extra={"session_id": sid})

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
        for event in data.recent:  # why it needs an operator is in its durable log, whichever node wrote it
            self.attention.observe(event, None)
        try:
            await recover(
                session,
                tool_calls=data.tool_calls,
                speeches=data.speeches,
                reported=data.reported,
                tools_of=self._tools_of,
                pending=data.pending,
            )
        except Exception:
            # half recovered: stop it here; the next round starts again from what is durable (as after a crash)
            if self.sessions.get(rec.id) is session:
                self.sessions.pop(rec.id, None)
                self.records.pop(rec.id, None)
            await session.suspend(tool_grace=False)
            raise
        self.recovered.append(rec.id)

    def _tools_of(self, agent: str) -> Mapping[str, FunctionTool]:
        """The tools of the registered agent ``agent`` (of a new instance of it): a call that agent made before the
        session handed off from it resumes with its own tool."""
        return self.registry.create(agent).tools if agent in self.registry else {}

    async def _fail(self, rec: SessionRecord, data: SessionData, *, reason: str, **extra: Any) -> None:
        """Mark a session that cannot be recovered ``failed``; the calls it left running still end (I5)."""
        epoch = self._epoch(rec)  # the claim this recovery acts under
        log = EventLog(rec.id, self._sink_for(epoch), last_seq=data.last_seq)
        report_missing(log, data.items, data.tool_calls, data.speeches, data.reported)
        chat = ChatContext(data.items)
        store = self._chat_store_for(epoch)
        interrupted = await end_orphaned_calls(rec.id, tool_calls=data.tool_calls, chat=chat, store=store, events=log)
        await self.store.mark_session(rec.id, SessionStatus.FAILED, epoch=epoch)
        await log.emit(SessionFailed(reason=reason, interrupted_calls=interrupted, **extra))
        self.failed.append(rec.id)

    def wake_adopt(self) -> None:
        self._adopt_ev.set()

    async def adopt_forever(self, interval_s: float, *, claim: bool = True) -> None:
        """Cluster mode: take over this node's share of the sessions no live node owns (those of dead nodes, those a
        draining node handed over): every ``interval_s``, as soon as the lease of another node passes, and when woken
        (``wake_adopt``). Each round also tries again the sessions whose recovery failed on an earlier one (with
        ``claim=False``, a single node: only those)."""
        while True:
            wait_s = await self.lease.next_adoption_in(interval_s) if self.lease and claim else interval_s
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._adopt_ev.wait()
            self._adopt_ev.clear()
            if not claim and not self._unrecovered and not self._uncertain:
                continue
            try:
                await self.recover_all(claim=claim)
            except Exception as err:
                if is_transient(err):  # a database outage: said once per round, without a traceback
                    logger.warning("adopting orphaned sessions: the database is unavailable (%r); will retry", err)
                else:
                    logger.exception("adopting orphaned sessions failed; will retry")

    async def hand_off_all(self) -> list[str]:
        """Drain (cluster mode, on SIGTERM): suspend each session (what was heard committed, tools given their grace,
        every write durable), then let go of it in the database so that a live node adopts it through recovery.
        Returns the sessions handed over. A command for one of them meanwhile answers 503 ``session_moving``, and once
        another node owns it, it is forwarded there."""
        lease = self.lease
        if lease is None:
            return []

        async def one(sid: str, session: AgentSession) -> str | None:
            rec = self.records.get(sid) if self.sessions.get(sid) is session else None
            epoch = rec.owner_epoch if rec is not None else None  # the claim this incarnation runs under
            await session.suspend()
            if self.sessions.get(sid) is session:
                self.sessions.pop(sid, None)
                self.records.pop(sid, None)
                self._active_at.pop(sid, None)
            if epoch is None or lease.fence.epochs.get(sid) != epoch:  # fenced meanwhile: another node has it already
                return None
            lease.fence.hand_off(sid)
            released = await self.store.nodes.release(lease.node_id, {sid: epoch})
            return released[0] if released else None

        async with self._round_lock:  # a round under way may still add sessions; one starting now claims none
            sessions = list(self.sessions.items())
        found = await asyncio.gather(*(one(sid, s) for sid, s in sessions), return_exceptions=True)
        for err in (f for f in found if isinstance(f, BaseException)):
            logger.error("handing a session over failed (it is adopted once this node's lease passed)", exc_info=err)
        return [sid for sid in found if isinstance(sid, str)]

    async def aclose(self) -> None:
        """Service shutdown: suspend every session (they stay live and are recovered on the next start)."""
        sessions = list(self.sessions.values())
        await asyncio.gather(*(s.suspend() for s in sessions), return_exceptions=True)
        if self._drops or self._starts:
            await asyncio.gather(*self._drops, *self._starts, return_exceptions=True)
        self.sessions.clear()
        self.records.clear()
