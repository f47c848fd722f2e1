"""The cluster's simulated database: what the nodes share, on the virtual clock, with faults.

It holds what PostgreSQL holds for the service (sessions with their owner and epoch, chat items, tool calls,
speeches, events, nodes with their leases, idempotency keys) and answers the statements the store makes, with the same
semantics (``test_conformance.py`` runs one sequence of operations against this model and against the real ``Store``
and compares the answers). Leases are set and judged by the database's clock, which is the virtual clock.

Faults: latency (each statement takes a while), a stall (every statement waits until it ends), one node
partitioned from the database (its statements wait), a connection reset on a statement (before the statement, or
after it committed: the caller cannot tell which), and a crashed node (its statements never return). Every statement
has a timeout, as the service's every database call has: a statement kept waiting past it fails with
``TimeoutError``, which the store treats as the database being away.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from switchboard.runtime.chat import ChatItem, order_items
from switchboard.runtime.events import Event
from switchboard.runtime.ports import Completion, Reported
from switchboard.runtime.speech import SpeechInfo
from switchboard.runtime.status import LIVE_STATUSES, SessionStatus
from switchboard.runtime.tools import ToolCallInfo
from switchboard.store.ownership import NodeMode, NodeRecord, NodeState, Owners, refusal
from switchboard.store.records import (
    Claim,
    Holder,
    IdempotencyRecord,
    IdempotencyState,
    ReceiptRefused,
    SessionExists,
    SessionRecord,
)
from switchboard.store.writes import Op

STATEMENT_TIMEOUT_S = 5.0
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
_LEASED = (NodeState.LIVE, NodeState.DRAINING)


def as_datetime(t: float) -> datetime:
    return EPOCH + timedelta(seconds=t)


def as_seconds(d: datetime) -> float:
    return (d - EPOCH).total_seconds()


@dataclass
class NodeRow:
    id: str
    url: str
    state: NodeState
    mode: NodeMode
    hostname: str
    pid: int
    started_at: datetime
    heartbeat_at: float
    lease_until: float
    incarnation: str


@dataclass
class SessionRows:
    """Everything durable of one session."""

    items: dict[str, ChatItem] = field(default_factory=dict)  # in append order (the chat position)
    tool_calls: dict[str, ToolCallInfo] = field(default_factory=dict)
    speeches: dict[str, SpeechInfo] = field(default_factory=dict)
    events: dict[int, Event] = field(default_factory=dict)
    landed: dict[str, float] = field(default_factory=dict)  # chat item id -> when it became durable

    def chat(self) -> list[ChatItem]:
        return order_items(self.items.values())

    def event_log(self) -> list[Event]:
        return [self.events[seq] for seq in sorted(self.events)]


class SimDatabase:
    def __init__(self, clock: Callable[[], float], *, leased_claims: bool = True) -> None:
        self.clock = clock
        self.leased_claims = leased_claims  # a claim checks its node's own lease (the product's, in the same statement)
        self.sessions: dict[str, SessionRecord] = {}
        self.rows: dict[str, SessionRows] = {}
        self.nodes: dict[str, NodeRow] = {}
        self.keys: dict[tuple[str, str], IdempotencyRecord] = {}
        self.cursor = 0
        # faults
        self.stalled_until = -1.0
        self.partitioned: dict[str, float] = {}  # node id -> until when its statements cannot reach the database
        self.resets: list[tuple[str | None, bool]] = []  # (node or any, after the commit) for the next statements
        self.crashed: set[str] = set()  # store ids (node incarnations) whose statements never return
        self.latency_s = 0.0  # each statement takes this long (a window for a crash between two of them)
        # the clock leases are judged by, for a statement of a node (the fix: the database's own, whoever asks)
        self.lease_clock: Callable[[str], float] = lambda node: self.clock()
        # what the oracles read
        self.stale_writes: list[str] = []
        self.statements = 0

    # -- faults -------------------------------------------------------------------------------------------------

    async def statement(self, node: str, store_id: str) -> bool:
        """Wait until a statement of ``node`` can run (or fail after ``STATEMENT_TIMEOUT_S``); True when the
        connection is to be reset once the statement has committed."""
        loop = asyncio.get_running_loop()
        if store_id in self.crashed:
            await loop.create_future()  # a dead process never hears back
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        give_up_at = self.clock() + STATEMENT_TIMEOUT_S
        while (blocked := max(self.stalled_until, self.partitioned.get(node, -1.0))) > self.clock():
            if self.clock() >= give_up_at:
                raise TimeoutError(f"statement of node {node} timed out (database unreachable)")
            await asyncio.sleep(min(blocked, give_up_at) - self.clock())
        if store_id in self.crashed:
            await loop.create_future()
        self.statements += 1
        for i, (target, after) in enumerate(self.resets):
            if target in (None, node):
                del self.resets[i]
                if not after:
                    raise ConnectionResetError("connection reset by peer (simulated)")
                return True
        return False

    # -- sessions -----------------------------------------------------------------------------------------------

    def session_rows(self, sid: str) -> SessionRows:
        return self.rows.setdefault(sid, SessionRows())

    def owners(self, sids: Iterable[str]) -> Owners:
        return {sid: (rec.owner_node, rec.owner_epoch) for sid in sids if (rec := self.sessions.get(sid)) is not None}

    def insert_session(self, rec: SessionRecord, receipt: Completion | None) -> None:
        if rec.id in self.sessions:
            raise SessionExists(rec.id)
        if receipt is not None:
            self.check_receipts([receipt])
            self.complete_receipts([receipt])
        self.sessions[rec.id] = rec.model_copy()
        self.session_rows(rec.id)

    def write_batch(
        self, batch: Sequence[Op], node_id: str | None, made: Mapping[asyncio.Future[None], int | None]
    ) -> tuple[dict[str, int], dict[Op, Any], Owners]:
        """One transaction of a store writer: the fencing check (``ownership.refusal``, the product's own), then the
        writes it lets land; a reservation no longer held by its holder rolls the whole batch back."""
        owners = self.owners(op.session_id for op in batch)
        refused = {}
        if node_id is not None:
            refused = {op: err for op in batch if (err := refusal(node_id, op.session_id, op.epoch, owners))}
        writable = [op for op in batch if op not in refused]
        self.check_receipts(done for op in writable if op.commit is not None for done in op.commit.receipts)
        for op in writable:
            self._apply(op)
            owner = owners.get(op.session_id)
            epoch = made.get(op.fut, op.epoch)
            if node_id is not None and owner is not None and epoch is not None and owner != (node_id, epoch):
                what = "commit" if op.commit else "event" if op.event else "mark"
                self.stale_writes.append(
                    f"{what} of {op.session_id} made under epoch {epoch} by {node_id} landed; row: {owner}"
                )
        return {}, refused, owners

    def _apply(self, op: Op) -> None:
        sid = op.session_id
        d = self.session_rows(sid)
        rec = self.sessions.get(sid)
        if op.commit is not None:
            c = op.commit
            self.complete_receipts(c.receipts)
            if c.session is not None and rec is not None:
                s = c.session
                self.sessions[sid] = rec.model_copy(
                    update={
                        "agent": s.agent,
                        "state": s.state,
                        "llm_state": s.llm_state,
                        "current_speech_id": s.current_speech_id,
                        "entered": s.entered,
                    }
                )
            for item in c.items:
                if item.id not in d.items:
                    d.items[item.id] = item
                    d.landed[item.id] = self.clock()
            for info in c.tool_calls:
                d.tool_calls[info.call_id] = info
            for sp in c.speeches:
                d.speeches[sp.id] = sp
        elif op.event is not None:
            if op.event.seq not in d.events:
                self.cursor += 1
                op.event.cursor = self.cursor
                d.events[op.event.seq] = op.event
            else:
                op.event.cursor = d.events[op.event.seq].cursor
        elif op.mark_state is not None and rec is not None:
            self.sessions[sid] = rec.model_copy(update={"state": op.mark_state})

    def live_sessions(self, ids: Sequence[str] | None) -> list[SessionRecord]:
        found = [rec for rec in self.sessions.values() if SessionStatus(rec.state) in LIVE_STATUSES]
        if ids is not None:
            wanted = set(ids)
            found = [rec for rec in found if rec.id in wanted]
        return [rec.model_copy() for rec in sorted(found, key=lambda r: (r.created_at, r.id))]

    # -- idempotency keys ---------------------------------------------------------------------------------------

    def check_receipts(self, receipts: Iterable[Completion]) -> None:
        for done in receipts:
            found = self.keys.get((done.key, done.scope))
            if found is None or not found.held_by(Holder(done.holder_node, done.holder_incarnation)):
                raise ReceiptRefused(done.key)

    def complete_receipts(self, receipts: Iterable[Completion]) -> None:
        for done in receipts:
            found = self.keys[(done.key, done.scope)]
            self.keys[(done.key, done.scope)] = found.model_copy(
                update={"state": IdempotencyState.DONE, "status_code": done.status_code, "response_body": done.body}
            )

    def holder_alive(self, rec: IdempotencyRecord, node: str) -> bool:
        row = self.nodes.get(rec.holder_node or "")
        return (
            row is not None
            and row.incarnation == rec.holder_incarnation
            and row.state in _LEASED
            and row.lease_until >= self.lease_clock(node)
        )

    def reserve(self, key: str, scope: str, request_hash: str, holder: Holder, node: str) -> Claim:
        found = self.keys.get((key, scope))
        if found is None:
            self.keys[(key, scope)] = IdempotencyRecord(
                key=key,
                scope=scope,
                request_hash=request_hash,
                status_code=0,
                state=IdempotencyState.PENDING,
                holder_node=holder.node,
                holder_incarnation=holder.incarnation,
            )
            return Claim(held=True)
        if found.state is IdempotencyState.DONE or found.request_hash != request_hash:
            return Claim(held=False, record=found)
        if self.holder_alive(found, node) and not found.held_by(holder):
            return Claim(held=False, record=found)
        old = Holder(found.holder_node or "", found.holder_incarnation or "")
        self.keys[(key, scope)] = found.model_copy(
            update={"holder_node": holder.node, "holder_incarnation": holder.incarnation}
        )
        return Claim(held=True, taken_from=None if found.held_by(holder) else old)

    def complete(self, done: Completion) -> bool:
        try:
            self.check_receipts([done])
        except ReceiptRefused:
            return False
        self.complete_receipts([done])
        return True

    def release_key(self, key: str, scope: str, holder: Holder) -> bool:
        found = self.keys.get((key, scope))
        if found is None or found.state is not IdempotencyState.PENDING or not found.held_by(holder):
            return False
        del self.keys[(key, scope)]
        return True

    # -- nodes (``store.ownership.Nodes``) ----------------------------------------------------------------------

    def node_record(self, row: NodeRow, node: str, sessions: int = 0) -> NodeRecord:
        return NodeRecord(
            id=row.id,
            url=row.url,
            state=row.state,
            mode=row.mode,
            hostname=row.hostname,
            pid=row.pid,
            started_at=row.started_at,
            heartbeat_at=as_datetime(row.heartbeat_at),
            lease_until=as_datetime(row.lease_until),
            sessions=sessions,
            lease_left_s=row.lease_until - self.lease_clock(node),
            incarnation=row.incarnation,
        )

    def bury(self, me: str, gone: Iterable[str]) -> None:
        now = self.lease_clock(me)
        gone = set(gone)
        for row in self.nodes.values():
            if row.state in _LEASED and row.id != me and (row.lease_until < now or row.id in gone):
                row.state = NodeState.DEAD

    def leased(self) -> set[str]:
        return {row.id for row in self.nodes.values() if row.state in _LEASED}

    def register(
        self, me: NodeRecord, gone: Iterable[str], conflicts: Callable[[NodeRecord], bool]
    ) -> list[NodeRecord]:
        lease_s = (me.lease_until - me.heartbeat_at).total_seconds()
        self.bury(me.id, gone)
        blocking = [
            rec
            for row in self.nodes.values()
            if row.state in _LEASED and row.id != me.id and conflicts(rec := self.node_record(row, me.id))
        ]
        if blocking:
            return blocking
        now = self.lease_clock(me.id)
        self.nodes[me.id] = NodeRow(
            me.id, me.url, me.state, me.mode, me.hostname, me.pid, me.started_at, now, now + lease_s, me.incarnation
        )
        for sid, rec in self.sessions.items():
            if rec.owner_node == me.id:
                self.sessions[sid] = rec.model_copy(update={"owner_node": None})
        return []

    def renew(self, node_id: str, lease_s: float) -> bool:
        row = self.nodes.get(node_id)
        if row is None or row.state not in _LEASED:
            return False
        now = self.lease_clock(node_id)
        row.heartbeat_at, row.lease_until = now, now + lease_s
        return True

    def release(self, node_id: str, claims: Mapping[str, int]) -> list[str]:
        released = []
        for sid, epoch in claims.items():
            rec = self.sessions.get(sid)
            if rec is not None and rec.owner_node == node_id and rec.owner_epoch == epoch:
                self.sessions[sid] = rec.model_copy(update={"owner_node": None})
                released.append(sid)
        return released

    def claim_orphans(self, node_id: str, share: bool) -> dict[str, int]:
        me = self.nodes.get(node_id)
        if self.leased_claims and (me is None or me.state not in _LEASED or me.lease_until < self.lease_clock(node_id)):
            return {}  # its own lease passed: it takes nothing (and buries no one)
        self.bury(node_id, ())
        leased = self.leased()
        live_nodes = {row.id for row in self.nodes.values() if row.state == NodeState.LIVE}
        live = [rec for rec in self.live_sessions(None)]
        orphans = [rec.id for rec in live if rec.owner_node is None or rec.owner_node not in leased]
        if share and orphans:
            loads: dict[str, int] = {}
            for rec in live:
                if rec.owner_node in live_nodes:
                    loads[rec.owner_node] = loads.get(rec.owner_node, 0) + 1
            n = max(len(live_nodes), 1)
            even = math.ceil((sum(loads.values()) + len(orphans)) / n)
            orphans = orphans[: max(math.ceil(len(orphans) / n), even - loads.get(node_id, 0))]
        claimed = {}
        for sid in orphans:
            rec = self.sessions[sid]
            self.sessions[sid] = rec.model_copy(update={"owner_node": node_id, "owner_epoch": rec.owner_epoch + 1})
            claimed[sid] = rec.owner_epoch + 1
        return claimed

    def owned_by(self, node_id: str) -> dict[str, int]:
        return {rec.id: rec.owner_epoch for rec in self.live_sessions(None) if rec.owner_node == node_id}

    def unowned(self, sids: Sequence[str]) -> list[str]:
        wanted = set(sids)
        return [rec.id for rec in self.live_sessions(None) if rec.id in wanted and rec.owner_node is None]

    def next_expiry_in(self, node_id: str) -> float | None:
        leases = [row.lease_until for row in self.nodes.values() if row.state in _LEASED and row.id != node_id]
        return min(leases) - self.lease_clock(node_id) if leases else None

    def live_url(self, node_id: str, asking: str) -> str | None:
        row = self.nodes.get(node_id)
        if row is None or row.state not in _LEASED or row.lease_until < self.lease_clock(asking):
            return None
        return row.url

    def list_nodes(self, states: Sequence[NodeState] | None, asking: str) -> list[NodeRecord]:
        counts: dict[str, int] = {}
        for rec in self.live_sessions(None):
            if rec.owner_node is not None:
                counts[rec.owner_node] = counts.get(rec.owner_node, 0) + 1
        rows = [row for row in self.nodes.values() if states is None or row.state in states]
        nodes = [self.node_record(row, asking, counts.get(row.id, 0)) for row in rows]
        return sorted(nodes, key=lambda node: (node.state != NodeState.LIVE, node.id))

    def set_state(self, node_id: str, state: NodeState) -> None:
        row = self.nodes.get(node_id)
        if row is not None:
            self.nodes[node_id] = replace(row, state=state)

    def reported(self, sid: str) -> Reported:
        return Reported.of(self.session_rows(sid).event_log())
