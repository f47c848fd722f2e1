"""Ownership with fencing: which node runs which session, and the check that keeps a node that lost a session from
ever writing for it again.

A node (a running ``switchboard serve``) has a row in ``nodes`` and a lease it renews (``lease_until``). It owns a
session when the session row names it (``owner_node``) at the epoch it claimed it with (``owner_epoch``). Taking a
session over increments its epoch in one statement; every write batch of the store checks, in its own transaction
and with the session rows locked, that the epoch it holds is still the row's. A node that was paused, partitioned
or simply replaced therefore cannot land a single late write: the check refuses it (``SessionFenced``), and the
node drops the session.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ..runtime.status import LIVE_STATUSES
from . import models as m
from .engine import IMMEDIATE
from .records import SessionFenced, now_utc

logger = logging.getLogger("switchboard.store.ownership")


class NodeState(StrEnum):
    LIVE = "live"  # renewing its lease
    DRAINING = "draining"  # stopping (SIGTERM): renews its lease, takes no new session, hands its sessions over
    STOPPED = "stopped"  # shut down cleanly; its sessions wait for the next node
    DEAD = "dead"  # its lease passed (seen by another node), or it lost it: its sessions are taken over


class NodeMode(StrEnum):
    SINGLE = "single"  # alone on its database: a second instance must not start beside it
    CLUSTER = "cluster"  # one of several nodes sharing PostgreSQL (and Redis)


@dataclass(frozen=True, slots=True)
class NodeRecord:
    id: str
    url: str
    state: NodeState
    mode: NodeMode
    hostname: str
    pid: int
    started_at: datetime
    heartbeat_at: datetime
    lease_until: datetime
    sessions: int = 0  # live sessions it owns (``list_nodes``)
    incarnation: str = ""  # this run of its process (a restart with the same id is another incarnation)

    def describe(self) -> str:
        return f"node {self.id} ({self.mode.value}, pid {self.pid} on {self.hostname}, {self.url})"


def _node_from_row(row: Any, sessions: int = 0) -> NodeRecord:
    return NodeRecord(
        id=row.id,
        url=row.url,
        state=NodeState(row.state),
        mode=NodeMode(row.mode),
        hostname=row.hostname,
        pid=int(row.pid),
        started_at=row.started_at,
        heartbeat_at=row.heartbeat_at,
        lease_until=row.lease_until,
        sessions=sessions,
        incarnation=row.incarnation or "",
    )


# The session rows of a batch, locked until the batch commits (PostgreSQL; SQLite's writer holds the database's write
# lock from BEGIN IMMEDIATE on, and renders no FOR UPDATE): a takeover waits for the batch or the batch sees it.
_OWNERS = (
    sa.select(m.sessions.c.id, m.sessions.c.owner_node, m.sessions.c.owner_epoch)
    .where(m.sessions.c.id.in_(sa.bindparam("ids", expanding=True)))
    .order_by(m.sessions.c.id)
    .with_for_update()
)
_LIVE = tuple(sorted(s.value for s in LIVE_STATUSES))
NODES_LOCK_KEY = 0x5357_4E4F_4445  # the advisory lock that serializes registrations and takeovers
# nodes holding a lease: a draining node still owns its sessions until it hands each one over
_LEASED = (NodeState.LIVE.value, NodeState.DRAINING.value)


class Fence:
    """This node's claims (session id -> the epoch it owns it at), checked by every write batch.

    ``on_fenced(session_id, why)`` is called (once per loss) when a session is found lost: by the check in a write
    transaction, or by ``lose``/``lose_all`` when the node lets go of it.
    """

    def __init__(self, node_id: str, on_fenced: Callable[[str, str], None] | None = None) -> None:
        self.node_id = node_id
        self.epochs: dict[str, int] = {}
        self.lost: dict[str, str] = {}  # session id -> why; its writes are refused without asking the database
        self.on_fenced = on_fenced
        self.refusals = 0  # writes refused
        # claimed since the writer last saw them: what it remembers of them (chat positions) may be another node's past
        self.fresh: set[str] = set()

    def claim(self, sid: str, epoch: int) -> None:
        self.epochs[sid] = epoch
        self.lost.pop(sid, None)
        self.fresh.add(sid)

    def release(self, sid: str) -> None:
        """Forget a session this node is done with (closed): a later write for it is refused by the check."""
        self.epochs.pop(sid, None)
        self.lost.pop(sid, None)

    def owns(self, sid: str) -> bool:
        return sid in self.epochs

    def hand_off(self, sid: str) -> None:
        """This node gave the session up (a drain): its writes for it are refused from now on, without a round trip
        (and without ``on_fenced``: nothing was lost)."""
        self.epochs.pop(sid, None)
        self.lost[sid] = "handed over to another node"

    def lose(self, sid: str, why: str) -> None:
        if sid in self.lost:
            return
        self.epochs.pop(sid, None)
        self.lost[sid] = why
        logger.error("session %s fenced: %s", sid, why, extra={"session_id": sid})
        if self.on_fenced is not None:
            try:
                self.on_fenced(sid, why)
            except Exception:
                logger.exception("session %s: on_fenced failed", sid)

    def lose_all(self, why: str) -> list[str]:
        sids = list(self.epochs)
        for sid in sids:
            self.lose(sid, why)
        return sids

    def refused_locally(self, sid: str) -> SessionFenced | None:
        """The error for a write of a session this node already knows it lost (no database round trip)."""
        why = self.lost.get(sid)
        if why is None:
            return None
        self.refusals += 1
        return SessionFenced(sid, why)

    def claims(self, sids: Iterable[str]) -> dict[str, int | None]:
        """The epoch this node holds for each of ``sids`` (None: never claimed), for ``check_owners``."""
        return {sid: self.epochs.get(sid) for sid in sids}


def check_owners(conn: Connection, node_id: str, claims: Mapping[str, int | None]) -> dict[str, SessionFenced]:
    """Inside the caller's write transaction: the sessions of ``claims`` node ``node_id`` may not write, with why.

    Synchronous (the store writer runs a whole batch in one call, on SQLite on a thread of its own). A claimed session
    must still name this node at the claimed epoch. A session this node never claimed may be written only while no
    node owns it (a row not created yet, or one no node has claimed)."""
    ids = sorted(claims)
    refused: dict[str, SessionFenced] = {}
    found: dict[str, tuple[str | None, int]] = {}
    for start in range(0, len(ids), 1000):
        rows = conn.execute(_OWNERS, {"ids": ids[start : start + 1000]})
        found.update({sid: (owner, int(epoch)) for sid, owner, epoch in rows})
    for sid in ids:
        if sid not in found:
            continue
        owner, epoch = found[sid]
        mine = claims[sid]
        if mine is None and owner is None:
            continue
        if mine is not None and owner == node_id and epoch == mine:
            continue
        why = f"owned by node {owner} at epoch {epoch}" + (f", not this node at epoch {mine}" if mine else "")
        refused[sid] = SessionFenced(sid, why)
    return refused


class Nodes:
    """The SQL of the ``nodes`` table and of session ownership (each method is its own transaction)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def _lock(self, conn: AsyncConnection) -> None:
        """Serialize registrations and takeovers (PostgreSQL; on SQLite the transaction began IMMEDIATE).

        An advisory lock, not a table lock: a lease renewal (an UPDATE of its own node row) must never wait for a
        takeover, which can take a while (it waits for the session rows a write batch holds). With renewals queued
        behind it, every node could miss its renewals at once and let go of all its sessions. A renewal racing a
        burial is settled by the row itself: the burial re-checks ``lease_until`` on the row the renewal wrote."""
        if conn.dialect.name == "postgresql":
            await conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": NODES_LOCK_KEY})

    async def _begin(self) -> AsyncConnection:
        conn = await self.engine.connect()
        if conn.dialect.name == "sqlite":
            conn = await conn.execution_options(**{IMMEDIATE: True})
        return conn

    async def list_nodes(self, *, states: Sequence[NodeState] | None = None) -> list[NodeRecord]:
        """Nodes (live ones first, then by id) with the number of live sessions each owns."""
        n, s = m.nodes, m.sessions
        counts = (
            sa.select(s.c.owner_node, sa.func.count())
            .where(s.c.owner_node.is_not(None), s.c.state.in_(_LIVE))
            .group_by(s.c.owner_node)
        )
        stmt = sa.select(n)
        if states is not None:
            stmt = stmt.where(n.c.state.in_([st.value for st in states]))
        async with self.engine.connect() as conn:
            owned = {owner: int(count) for owner, count in await conn.execute(counts)}
            rows = (await conn.execute(stmt)).all()
        nodes = [_node_from_row(row, owned.get(row.id, 0)) for row in rows]
        return sorted(nodes, key=lambda node: (node.state != NodeState.LIVE, node.id))

    async def register(
        self, me: NodeRecord, *, gone: Iterable[str] = (), conflicts: Callable[[NodeRecord], bool]
    ) -> list[NodeRecord]:
        """Register ``me`` as live, unless a live node for which ``conflicts`` is true holds a lease: those are
        returned and nothing is written. Nodes whose lease passed, and those of ``gone`` (known dead), are marked
        dead first. Sessions the database says ``me`` owns (a previous run with the same id) are let go of."""
        now = now_utc()
        n = m.nodes
        conn = await self._begin()
        try:
            async with conn.begin():
                await self._lock(conn)
                await self._bury(conn, now, me.id, gone)
                rows = (await conn.execute(sa.select(n).where(n.c.state.in_(_LEASED), n.c.id != me.id))).all()
                blocking = [node for node in map(_node_from_row, rows) if conflicts(node)]
                if blocking:
                    return blocking
                row = {
                    "id": me.id,
                    "url": me.url,
                    "state": me.state.value,
                    "mode": me.mode.value,
                    "hostname": me.hostname,
                    "pid": me.pid,
                    "started_at": me.started_at,
                    "heartbeat_at": now,
                    "lease_until": me.lease_until,
                    "incarnation": me.incarnation,
                }
                await conn.execute(sa.delete(n).where(n.c.id == me.id))
                await conn.execute(sa.insert(n), [row])
                s = m.sessions
                await conn.execute(sa.update(s).where(s.c.owner_node == me.id).values(owner_node=None))
        finally:
            await conn.close()
        return []

    async def _share(self, conn: AsyncConnection, node_id: str, orphans: int, live_nodes: sa.Select[Any]) -> int:
        s = m.sessions
        owned = sa.select(s.c.owner_node, sa.func.count()).where(s.c.state.in_(_LIVE), s.c.owner_node.in_(live_nodes))
        loads = {owner: int(count) for owner, count in await conn.execute(owned.group_by(s.c.owner_node))}
        nodes = int((await conn.execute(sa.select(sa.func.count()).select_from(live_nodes.subquery()))).scalar() or 1)
        even = math.ceil((sum(loads.values()) + orphans) / nodes)
        return max(math.ceil(orphans / nodes), even - loads.get(node_id, 0))

    async def _bury(self, conn: AsyncConnection, now: datetime, me: str, gone: Iterable[str]) -> None:
        n = m.nodes
        expired = sa.or_(n.c.lease_until < now, n.c.id.in_(list(gone)))
        await conn.execute(
            sa.update(n).where(n.c.state.in_(_LEASED), n.c.id != me, expired).values(state=NodeState.DEAD)
        )

    async def live_url(self, node_id: str) -> str | None:
        """The address of ``node_id`` while it holds its lease (live or draining), else None."""
        n = m.nodes
        stmt = sa.select(n.c.url).where(n.c.id == node_id, n.c.state.in_(_LEASED), n.c.lease_until >= now_utc())
        async with self.engine.connect() as conn:
            return (await conn.execute(stmt)).scalar()

    async def next_expiry(self, node_id: str) -> datetime | None:
        """When the first lease of the other nodes holding one passes (None: no other such node): a node that died
        is found dead then, not a polling interval later."""
        n = m.nodes
        stmt = sa.select(sa.func.min(n.c.lease_until)).where(n.c.state.in_(_LEASED), n.c.id != node_id)
        async with self.engine.connect() as conn:
            expiry: datetime | None = (await conn.execute(stmt)).scalar()
        return expiry

    async def renew(self, node_id: str, lease_s: float) -> bool:
        """Extend this node's lease; False when it holds none any more (another node buried it)."""
        now = now_utc()
        n = m.nodes
        async with self.engine.begin() as conn:
            result = await conn.execute(
                sa.update(n)
                .where(n.c.id == node_id, n.c.state.in_(_LEASED))
                .values(heartbeat_at=now, lease_until=now + timedelta(seconds=lease_s))
            )
        return bool(result.rowcount)

    async def set_state(self, node_id: str, state: NodeState) -> None:
        n = m.nodes
        async with self.engine.begin() as conn:
            await conn.execute(sa.update(n).where(n.c.id == node_id).values(state=state))

    async def release(self, node_id: str, claims: Mapping[str, int]) -> list[str]:
        """Let go of sessions this node owns at the given epochs (a drain hands them over): each one is then owned by
        no node, and the next ``claim_orphans`` of a live node takes it. Returns those released."""
        s = m.sessions
        stmt = (
            sa.update(s)
            .where(s.c.id == sa.bindparam("b_id"), s.c.owner_node == node_id, s.c.owner_epoch == sa.bindparam("b_ep"))
            .values(owner_node=None)
        )
        released: list[str] = []
        async with self.engine.begin() as conn:
            for sid, epoch in claims.items():
                if (await conn.execute(stmt, {"b_id": sid, "b_ep": epoch})).rowcount:
                    released.append(sid)
        return released

    async def unowned(self, sids: Sequence[str]) -> list[str]:
        """Those of ``sids`` that are live and owned by no node (released, not adopted yet)."""
        if not sids:
            return []
        s = m.sessions
        stmt = sa.select(s.c.id).where(s.c.id.in_(list(sids)), s.c.owner_node.is_(None), s.c.state.in_(_LIVE))
        async with self.engine.connect() as conn:
            return [sid for (sid,) in await conn.execute(stmt)]

    async def claim_orphans(self, node_id: str, *, share: bool = False) -> dict[str, int]:
        """Take over live sessions no live node owns (never claimed, or owned by a node that stopped or whose lease
        passed): each one's epoch is incremented and this node named its owner, in one transaction. With ``share``
        it takes only its share: what brings it to an even load among the live nodes (and at least orphans / live
        nodes, rounded up), so the nodes split a dead node's sessions.
        Returns the sessions taken, with their new epochs."""
        now = now_utc()
        n, s = m.nodes, m.sessions
        conn = await self._begin()
        try:
            async with conn.begin():
                await self._lock(conn)
                await self._bury(conn, now, node_id, ())
                live_nodes = sa.select(n.c.id).where(n.c.state == NodeState.LIVE)
                leased = sa.select(n.c.id).where(n.c.state.in_(_LEASED))
                orphan = sa.and_(s.c.state.in_(_LIVE), sa.or_(s.c.owner_node.is_(None), s.c.owner_node.not_in(leased)))
                ids = [
                    sid
                    for (sid,) in await conn.execute(sa.select(s.c.id).where(orphan).order_by(s.c.created_at, s.c.id))
                ]
                if share and ids:
                    ids = ids[: await self._share(conn, node_id, len(ids), live_nodes)]
                claimed: dict[str, int] = {}
                for start in range(0, len(ids), 1000):
                    stmt = (
                        sa.update(s)
                        .where(s.c.id.in_(ids[start : start + 1000]), orphan)
                        .values(owner_node=node_id, owner_epoch=s.c.owner_epoch + 1)
                        .returning(s.c.id, s.c.owner_epoch)
                    )
                    claimed.update({sid: int(epoch) for sid, epoch in await conn.execute(stmt)})
        finally:
            await conn.close()
        return claimed


__all__ = ["Fence", "NodeMode", "NodeRecord", "NodeState", "Nodes", "SessionFenced", "check_owners"]
