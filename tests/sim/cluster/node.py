"""One node of the simulated cluster: the product's ``SessionHost`` and ``NodeLease`` on a ``SimStore``.

The lease runs as the product runs it, except that its renewal thread is a task of the node (so a paused node renews
nothing, as a frozen process does) and its monotonic clock is the virtual one. The node answers the commands a
load balancer sends it as the API does: a session it runs is served here (idempotent commands through the product's
reservation and receipt code, ``api.idempotency``), one another live node owns is forwarded there, any other answers
503 and the client retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.responses import Response

from switchboard.api.idempotency import Attempt, KeyLocks, _run_once
from switchboard.api.problems import ProblemError
from switchboard.control.cluster.drain import drain
from switchboard.control.cluster.ownership import HEARTBEAT_S, RENEWALS_PER_LEASE, NodeLease
from switchboard.control.host import SessionHost
from switchboard.control.hub import EventHub
from switchboard.control.settings import Settings
from switchboard.control.webhook_reports import apply_result, refusal
from switchboard.integrations.webhooks import BackendResult, CallAlreadyEnded, NotAwaitingReport, Webhooks
from switchboard.runtime.session import AgentSession
from switchboard.runtime.speech import NotInterruptible
from switchboard.runtime.status import SessionClosed, SessionStatus, SessionSuspended
from switchboard.runtime.tools import ToolCallInfo
from switchboard.store.ownership import NodeState
from switchboard.store.records import Holder, SessionFenced, StoreError

from .links import app
from .loop import run_in_node
from .store import SimStore
from .webhooks import backend, registry

if TYPE_CHECKING:
    from .world import ClusterWorld

ADOPT_INTERVAL_S = 1.0
DRAIN_TIMEOUT_S = 10.0  # the service's drain_timeout_s
DRAIN_BOUND_S = 40.0
# what a command may fail with while its session moves: the API answers these 503 (retry), never 5xx
RETRYABLE = (SessionSuspended, SessionFenced, StoreError, TimeoutError, OSError, asyncio.CancelledError)


@dataclass
class Command:
    kind: str  # input | say | interrupt | progress | result (a webhook backend's reports)
    sid: str
    key: str | None = None
    text: str = ""
    interrupt: bool = False
    call_id: str = ""


@dataclass
class Answer:
    status: int
    code: str = ""
    body: Any = None


class Node:
    """One incarnation of node ``node_id`` (a restart is a new ``Node`` with the same id)."""

    def __init__(self, world: ClusterWorld, node_id: str, incarnation: int, settings: Settings) -> None:
        self.world = world
        self.id = node_id
        self.tag = f"{node_id}#{incarnation}"  # the loop's name for this process
        self.settings = settings
        self.store = SimStore(
            world.db,
            node_id,
            self.tag,
            write_time_epochs=world.fixes.write_time_epochs,
            receipts_with_effect=world.fixes.receipts_with_effect,
        )
        self.lease = NodeLease(self.store, settings)  # type: ignore[arg-type]
        self.webhooks = Webhooks(transport=backend(world.delivered))
        self.lease.hostname = f"host-{node_id}"  # one machine each: no node takes another for its own dead process
        self.host = SessionHost(
            store=self.store,  # type: ignore[arg-type]
            registry=registry(self.webhooks, resume=world.fixes.resume_calls),
            hub=EventHub(),
            settings=settings,
            lease=self.lease,
        )
        self.locks = KeyLocks()
        self.app = app(self)  # what its routes find as ``ws.app`` (its services, its per-process tables)
        self.up = False  # registered and serving
        self.gone = False  # killed, or exited after a drain
        self.drained = False  # its drain and shutdown ran to their end: it exits with nothing left unwritten
        self.tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = run_in_node(self.tag, asyncio.ensure_future, coro)
        task.set_name(f"{self.tag}:{name}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    # -- lifecycle ----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Register (retrying while the database is away), then serve: watch and renew the lease, adopt."""
        self.store.start()
        lease = self.lease
        lease._loop = asyncio.get_running_loop()
        while True:
            sent = asyncio.get_running_loop().time()
            try:
                if not await lease._register_once(self.store.nodes):  # type: ignore[arg-type]
                    break
            except (TimeoutError, OSError):
                pass
            await asyncio.sleep(0.5)
        lease._renewed(sent)
        self.store.use_fence(lease.fence)
        lease.loop_stamp = asyncio.get_running_loop().time()
        self.spawn(self._watch(), "lease-watch")
        self.spawn(self._renew(), "lease-renew")
        self.up = True
        with contextlib.suppress(Exception):
            await self.host.recover_all()
        self.spawn(self.host.adopt_forever(ADOPT_INTERVAL_S), "adopt")

    async def _watch(self) -> None:
        lease = self.lease
        beat_s = min(HEARTBEAT_S, lease.lease_s / 20)
        while True:
            lease._check_renewed()
            lease.loop_stamp = asyncio.get_running_loop().time()
            await asyncio.sleep(beat_s)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.lease.lease_s / RENEWALS_PER_LEASE)
            await self.lease.renew_once(self.store.nodes)  # type: ignore[arg-type]

    async def drain(self) -> None:
        """SIGTERM: the product's drain (take no new session, hand every session over, wake the others through Redis,
        wait until they own them), then what the service's shutdown does: suspend what is left, write what is
        queued, record the stop. Then the process exits."""

        async def wake() -> None:
            self.world.redis_publish(self, "handed-over")

        try:
            async with asyncio.timeout(DRAIN_BOUND_S):
                await drain(self.host, wake=wake, timeout_s=DRAIN_TIMEOUT_S)
                await self.host.aclose()
                await self.store.writer.aclose(timeout_s=10.0)
                with contextlib.suppress(TimeoutError, OSError):
                    await self.store.nodes.set_state(self.id, NodeState.STOPPED)
                self.drained = not self.store.writer.made
        except (TimeoutError, OSError) as err:
            self.world.note(f"{self.tag}: drain cut short ({err!r})")

    # -- serving ------------------------------------------------------------------------------------------------

    def live(self, sid: str) -> AgentSession | None:
        return self.host.live(sid) if self.up and not self.gone else None

    async def handle(self, cmd: Command, *, forwarded: bool = False) -> Answer:
        """A request the load balancer (or another node) sent here."""
        try:
            if self.live(cmd.sid) is None:
                return await self._route(cmd, forwarded)
            return await self._run_here(cmd)
        except ProblemError as err:
            return Answer(err.status, err.code)
        except (CallAlreadyEnded, NotAwaitingReport) as err:
            return await self._refused(cmd, err)
        except RETRYABLE as err:
            return Answer(503, type(err).__name__)
        except (SessionClosed, LookupError) as err:
            return Answer(409, type(err).__name__)
        except NotInterruptible:
            return Answer(409, "not_interruptible")

    async def _refused(self, cmd: Command, err: CallAlreadyEnded | NotAwaitingReport) -> Answer:
        """A report no call here took, answered as the report routes answer it (``webhook_reports.refusal``)."""
        try:
            refused = await refusal(self.host, cmd.sid, cmd.call_id, err)
        except RETRYABLE as read_err:  # the store's read failed: the route answers 503 too
            return Answer(503, type(read_err).__name__)
        if refused.retry:
            return Answer(503, refused.code)
        return Answer(404 if refused.code.endswith("not_found") else 409, refused.code)

    async def _route(self, cmd: Command, forwarded: bool) -> Answer:
        rec = await self.store.get_session(cmd.sid)
        if rec is None:
            return Answer(404, "session_not_found")
        if not SessionStatus(rec.state).live:
            return Answer(409, "session_not_active")
        owner = rec.owner_node
        if forwarded or owner is None or owner == self.id or await self.store.nodes.live_url(owner) is None:
            return Answer(503, "session_recovering")
        return await self.world.forward(owner, cmd)

    async def _run_here(self, cmd: Command) -> Answer:
        if cmd.key is None:
            body = await self._effect(cmd, None)
            return Answer(200, body=body)
        holder = Holder(self.lease.node_id, self.lease.incarnation)
        scope = f"sim POST /v1/sessions/{cmd.sid}/{cmd.kind}"
        response = Response()
        response.status_code = None  # type: ignore[assignment]  # as FastAPI's sub-response: the route's default
        attempt = Attempt(cmd.key, scope, self.store, self.settings, response, 202, holder)  # type: ignore[arg-type]
        digest = hashlib.sha256(json.dumps([cmd.kind, cmd.text], sort_keys=True).encode()).hexdigest()

        async def call() -> Any:
            return await self._effect(cmd, attempt)

        answered = await _run_once(attempt, cmd.key, digest, self.locks, call)
        body = json.loads(bytes(answered.body)) if answered.body else None
        return Answer(answered.status_code, body=body)

    async def _effect(self, cmd: Command, attempt: Attempt | None) -> Any:
        session = self.live(cmd.sid)
        if session is None:
            raise SessionSuspended(f"session {cmd.sid} is not here any more")
        if cmd.kind == "input":
            receipt = attempt.receipt(lambda r: {"item_id": r.item_id, "speech_id": r.speech_id}) if attempt else None
            result = await session.input(cmd.text, interrupt=cmd.interrupt, receipt=receipt)
            return {"item_id": result.item_id, "speech_id": result.speech_id}
        if cmd.kind == "say":
            receipt = attempt.receipt(lambda sp: {"speech_id": sp.id}) if attempt else None
            speech = await session.say(cmd.text, receipt=receipt)
            return {"speech_id": speech.id}
        if cmd.kind == "interrupt":
            speech = await session.interrupt()
            return {"speech_id": speech.id if speech else None}
        return await self._report(session, cmd, attempt)

    async def _report(self, session: AgentSession, cmd: Command, attempt: Attempt | None) -> Any:
        """A webhook backend's report, as the report routes apply it."""

        def render(info: ToolCallInfo) -> dict[str, Any]:
            return {"call_id": info.call_id, "status": info.status.value}

        receipt = attempt.receipt(render) if attempt else None
        broker = self.webhooks.broker
        if cmd.kind == "progress":
            await asyncio.shield(broker.progress(cmd.sid, cmd.call_id, cmd.text, 0.5, receipt))
        elif cmd.kind == "result":
            result = BackendResult(output=cmd.text, is_error=False)
            await asyncio.shield(apply_result(broker, cmd.sid, cmd.call_id, result, receipt))
        else:
            raise ValueError(f"unknown command {cmd.kind}")
        # answered as the route does: from the session as this node finds it now (the store's, once it moved)
        live = self.live(cmd.sid)
        info = live.tool_call(cmd.call_id) if live is not None else None
        if info is None:
            info = await self.store.tool_call(cmd.sid, cmd.call_id)
        return render(info) if info is not None else None
