"""Alerts: each session's reasons for attention (``control.attention``) delivered to the operator's webhook sinks, one
alert per session and reason from the moment it appears until it clears, then one "cleared".

Who sends: the node that runs the session, since only it knows the session's live reasons. Every ``interval_s`` it
compares the reasons of its sessions with their open alerts:

- a reason with no open alert opens one: inserted in the database, where at most one alert per session and reason is
  open (``store.alerts``), so a session adopted from another node finds the alert its previous owner opened and does
  not open it again;
- an open alert whose reason is gone is cleared, by a conditional update only one node can win;
- an open alert of a session that ended (closed, or failed: then all but its ``session_failed`` one) is cleared by
  whichever node sees it first, so a session that ends while it moves, or on a node that dies, still clears.

The node that wins a transition owes its deliveries; when it stops or dies with some not final, another node (or the
same node restarted) takes them over from the database. What a sink receives and when: ``control.alerts.dispatch``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from datetime import timedelta

from ...runtime.chat import new_id, utcnow
from ...runtime.session import AgentSession
from ...store import Store
from ...store.alerts import CLEARED, OPENED, AlertRecord, Delivery, DeliveryState, leased_nodes
from ..attention import AttentionCode, AttentionReason, AttentionTracker
from ..settings import AlertSink
from .dispatch import DeliveryObserver, Dispatcher, Job, RetryPolicy, payload

logger = logging.getLogger("switchboard.control.alerts")

FAILED_ALERT_S = 24 * 3600.0  # a failed session's alert stays open this long (as long as the attention list shows it)
FAILED_REMEMBERED = 1000  # failed sessions whose alert this node opened (or found open): not tried again
TAKEOVER_EVERY = 5  # rounds between two looks for deliveries a node gone left owed
SWEEP_LIMIT = 100  # alerts cleared, or deliveries taken over, per round at most


class AlertEngine:
    """Opens and clears the alerts of the sessions one node runs, and sends what it owes (see the module)."""

    def __init__(
        self,
        *,
        store: Store,
        tracker: AttentionTracker,
        sessions: dict[str, AgentSession],
        node_id: str,
        sinks: list[AlertSink],
        policy: RetryPolicy,
        interval_s: float,
        observer: DeliveryObserver | None = None,
        store_unavailable: Callable[[], bool] | None = None,
    ) -> None:
        self.store = store
        self.tracker = tracker
        self.sessions = sessions  # the host's live sessions (read, never changed)
        self.node_id = node_id
        self.sinks = {sink.name: sink for sink in sinks}
        self.interval_s = interval_s
        self.dispatcher = Dispatcher(sinks, policy, self._on_status, observer)
        self._store_unavailable = store_unavailable
        self._open: dict[str, dict[str, AlertRecord]] = {}  # session -> reason -> its open alert (sessions run here)
        self._failed_done: OrderedDict[str, None] = OrderedDict()
        self._sending: dict[tuple[str, str], AlertRecord] = {}  # (alert, transition) -> alert, deliveries under way
        self._write_lock = asyncio.Lock()
        self.rounds = 0
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle --------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.dispatcher.start()
        self._task = asyncio.create_task(self._run(), name="alerts")

    async def aclose(self) -> None:
        """Stop comparing and sending; deliveries not final stay owed in the database, for whoever runs next."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.dispatcher.aclose()

    async def _run(self) -> None:
        failing = False
        while True:
            try:
                await self.round()
            except Exception as err:
                # once per outage with its traceback (the database down fails every round until it is back)
                if not failing:
                    logger.exception("alerts: a round failed; trying again every %.1f s", self.interval_s)
                else:
                    logger.debug("alerts: a round failed again: %r", err)
                failing = True
            else:
                if failing:
                    logger.info("alerts: rounds succeed again")
                failing = False
            await asyncio.sleep(self.interval_s)

    # -- one round --------------------------------------------------------------------------------------------

    async def round(self) -> None:
        """Compare every session's reasons with its open alerts once (see the module)."""
        if self.rounds == 0:  # what this node owed before it restarted (the same node id), before anything new
            await self._take_over(own=True)
        live = dict(self.sessions)
        await self._load(live)
        current = self._current(live)
        await self._open_new(current, live)
        await self._clear_gone(live, current)
        await self._open_failed()
        await self._clear_ended()
        self.rounds += 1
        if self.rounds % TAKEOVER_EVERY == 1:
            await self._take_over(own=False)

    async def _load(self, live: dict[str, AgentSession]) -> None:
        """Forget the sessions no longer run here (their next owner, or the sweep of ended ones, clears them) and read
        the open alerts of those new here (a session adopted with its alerts open)."""
        for sid in [sid for sid in self._open if sid not in live]:
            del self._open[sid]
        new = [sid for sid in live if sid not in self._open]
        for sid in new:
            self._open[sid] = {}
        for alert in await self.store.alerts.open_for(new):
            self._open[alert.session_id][alert.reason] = alert

    def _reasons(self, sid: str, live: AgentSession | None) -> list[AttentionReason]:
        unavailable = self._store_unavailable() if self._store_unavailable is not None else False
        return self.tracker.reasons(sid, live, store_unavailable=unavailable)

    def _current(self, live: dict[str, AgentSession]) -> dict[tuple[str, str], AttentionReason]:
        return {(sid, str(r.code)): r for sid, session in live.items() for r in self._reasons(sid, session)}

    async def _open_new(self, current: dict[tuple[str, str], AttentionReason], live: dict[str, AgentSession]) -> None:
        for (sid, code), reason in current.items():
            if code in self._open.get(sid, {}):
                continue
            session = live[sid]
            agents = [session.agent.name]
            alert = await self._open_one(sid, reason, agents)
            if alert is not None:
                self._open.setdefault(sid, {})[code] = alert

    async def _open_one(self, sid: str, reason: AttentionReason, agents: list[str]) -> AlertRecord | None:
        """Open the alert of ``reason``, or find the one open already; None if neither (the session is gone)."""
        code = str(reason.code)
        sinks = [name for name, sink in self.sinks.items() if sink.subscribes(code, agents)]
        alert = AlertRecord(
            id=new_id("alrt"),
            session_id=sid,
            reason=code,
            agent=agents[0],
            message=reason.message,
            since=reason.since,
            opened_at=utcnow(),
            opened_node=self.node_id,
            opened_deliveries={name: Delivery() for name in sinks},
        )
        if await self.store.alerts.open(alert):
            logger.info(
                "alert %s opened: session %s, %s (%s); to sink(s): %s",
                alert.id,
                sid,
                code,
                reason.message,
                ", ".join(sinks) or "none",
                extra={"session_id": sid},
            )
            await self._send(alert, OPENED)
            return alert
        found = await self.store.alerts.open_for([sid])
        return next((a for a in found if a.reason == code), None)

    async def _clear_gone(self, live: dict[str, AgentSession], current: dict[tuple[str, str], AttentionReason]) -> None:
        for sid in live:
            for code, alert in list(self._open.get(sid, {}).items()):
                if (sid, code) not in current:
                    await self._clear(alert, "its reason is gone")
                    del self._open[sid][code]  # once cleared: a clear that failed is tried again next round

    async def _clear(self, alert: AlertRecord, why: str) -> None:
        sinks = [name for name in alert.opened_deliveries if name in self.sinks]
        cleared = await self.store.alerts.clear(
            alert.id, node=self.node_id, at=utcnow(), deliveries={name: Delivery() for name in sinks}
        )
        if cleared is None:
            return  # another node cleared it first
        logger.info("alert %s cleared: session %s, %s (%s)", alert.id, alert.session_id, alert.reason, why)
        await self._send(cleared, CLEARED)

    async def _open_failed(self) -> None:
        """The sessions that failed on this node: their alert opens here (they run nowhere)."""
        since = utcnow() - timedelta(seconds=FAILED_ALERT_S)
        for sid in self.tracker.failed_sessions():
            if sid in self._failed_done or sid in self.sessions:
                continue
            reasons = [r for r in self.tracker.reasons(sid, None) if r.code == AttentionCode.SESSION_FAILED]
            if reasons and reasons[0].since >= since:
                await self._open_one(sid, reasons[0], [await self._agent_of(sid)])
            self._failed_done[sid] = None
            while len(self._failed_done) > FAILED_REMEMBERED:
                self._failed_done.popitem(last=False)

    async def _agent_of(self, sid: str) -> str:
        rec = await self.store.get_session(sid)
        return rec.agent if rec is not None else ""

    async def _clear_ended(self) -> None:
        keep = utcnow() - timedelta(seconds=FAILED_ALERT_S)
        for alert in await self.store.alerts.open_of_ended(keep_failed_since=keep, limit=SWEEP_LIMIT):
            await self._clear(alert, "its session ended")

    async def _take_over(self, *, own: bool) -> None:
        """Deliveries owed by a node that is gone (``own``: or by this node before it restarted): sent from here."""
        outstanding = await self.store.alerts.outstanding(limit=SWEEP_LIMIT)
        if not outstanding:
            return
        leased = leased_nodes(await self.store.nodes.list_nodes())
        for alert in outstanding:
            for kind, owner in ((OPENED, alert.opened_node), (CLEARED, alert.cleared_node)):
                if (alert.id, kind) in self._sending or not _pending(alert.deliveries(kind)):
                    continue
                if (owner == self.node_id and not own) or (owner != self.node_id and owner in leased):
                    continue
                if await self.store.alerts.take_over(alert.id, kind, gone=owner, node=self.node_id):
                    logger.info("alert %s: taking over its %s deliveries from node %s", alert.id, kind, owner)
                    await self._send(alert, kind)

    # -- deliveries -------------------------------------------------------------------------------------------

    async def _send(self, alert: AlertRecord, kind: str) -> None:
        deliveries = alert.deliveries(kind)
        pending = {name: d for name, d in deliveries.items() if not d.final and name in self.sinks}
        if not pending:
            return
        self._sending[(alert.id, kind)] = alert
        body = payload(alert, kind)
        for name, status in pending.items():
            await self.dispatcher.put(Job(alert.id, alert.session_id, kind, name, body, status))

    async def _on_status(self, job: Job) -> None:
        """A delivery changed: stored with the others of its transition (never raises: a worker goes on)."""
        alert = self._sending.get((job.alert_id, job.kind))
        if alert is None:
            return
        deliveries = dict(alert.deliveries(job.kind))
        deliveries[job.sink] = job.status.model_copy()
        if job.kind == OPENED:
            alert.opened_deliveries = deliveries
        else:
            alert.cleared_deliveries = deliveries
        try:
            async with self._write_lock:
                await self.store.alerts.record(job.alert_id, job.kind, deliveries)
        except Exception as err:
            logger.warning("alert %s: its delivery status could not be stored (%r)", job.alert_id, err)
        if not _pending(deliveries):  # after the write: until then a look for owed deliveries must skip it
            self._sending.pop((job.alert_id, job.kind), None)

    def open_alerts(self) -> int:
        return sum(len(by_reason) for by_reason in self._open.values())

    def waiting(self) -> dict[str, int]:
        return self.dispatcher.waiting()


def _pending(deliveries: dict[str, Delivery] | Iterable[Delivery]) -> bool:
    values = deliveries.values() if isinstance(deliveries, dict) else deliveries
    return any(d.state == DeliveryState.PENDING for d in values)
