"""Ownership with fencing: which node runs which session, and the check that keeps a node that lost a session from
ever writing for it again.

A node (a running ``switchboard serve``) has a row in ``nodes`` and a lease it renews (``lease_until``). It owns a
session when the session row names it (``owner_node``) at the epoch it claimed it with (``owner_epoch``). Taking a
session over increments its epoch in one statement. Every write carries the epoch it was made under (a fencing token:
the epoch of the claim the live session that made it was created or adopted at), and every write batch of the store
checks, in its own transaction and with the session rows locked, that each write's epoch is still the row's. A node
that was paused, partitioned or simply replaced therefore cannot land a single late write, nor can a node that lost a
session and took it back land what the old incarnation still had under way: the check refuses it (``SessionFenced``).

Leases are set and judged on one clock, the database's (``db_now``): never a node's own, which may run ahead of the
others' and would bury their live leases.
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
from .engine import IMMEDIATE, whole
from .records import SessionFenced

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
    # seconds until its lease passes on the database's clock, as read (negative: passed); None: not read
    lease_left_s: float | None = None
    incarnation: str = ""  # this run of its process (a restart with the same id is another incarnation)

    @property
    def leased(self) -> bool:
        """It held its lease when it was read (judged on the database's clock)."""
        return self.lease_left_s is not None and self.lease_left_s > 0

    def describe(self) -> str:
        return f"node {self.id} ({self.mode.value}, pid {self.pid} on {self.hostname}, {self.url})"


def _node_from_row(row: Any, sessions: int = 0) -> NodeRecord:
    left = getattr(row, "lease_left_s", None)
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
        lease_left_s=float(left) if left is not None else None,
        incarnation=row.incarnation or "",
    )


def _node_columns(dialect: str) -> sa.Select[Any]:
    n = m.nodes
    return sa.select(n, seconds_until(dialect, n.c.lease_until).label("lease_left_s"))


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


def db_now(dialect: str, after_s: float = 0.0) -> sa.ColumnElement[datetime]:
    """The database's clock, plus ``after_s`` seconds: leases are set and judged by it alone.

    PostgreSQL: ``clock_timestamp()`` (``now()`` is when the transaction began). SQLite (one node on one machine): the
    text the timestamp columns hold there (``YYYY-MM-DD HH:MM:SS.ffffff``, UTC), to the millisecond, so that a stored
    value and this one compare as text exactly as the times they stand for."""
    if dialect == "postgresql":
        now: sa.ColumnElement[Any] = sa.func.clock_timestamp()
        if after_s:
            now = now + sa.literal(timedelta(seconds=after_s), sa.Interval())
    else:
        now = sa.func.strftime("%Y-%m-%d %H:%M:%f", "now", f"{after_s:+.3f} seconds").concat("000")
    return sa.type_coerce(now, m.TZDateTime())


def seconds_until(dialect: str, when: sa.ColumnElement[datetime]) -> sa.ColumnElement[float]:
    """How many seconds from now on the database's clock until ``when`` (negative: passed)."""
    if dialect == "postgresql":
        return sa.cast(sa.extract("epoch", when - sa.func.clock_timestamp()), sa.Float())
    return sa.cast((sa.func.julianday(when) - sa.func.julianday("now")) * 86400.0, sa.Float())


class Fence:
    """This node's claims (session id -> the epoch it owns it at): which sessions it runs, and the writes it refuses
    without asking the database (those of sessions it knows it lost, and those made under an epoch it no longer
    holds). The database's check in each write batch is what fencing rests on.

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

    def lose(self, sid: str, why: str, *, epoch: int | None = None) -> None:
        """The node lost ``sid`` (with ``epoch``: only if it still holds it at that epoch; a claim made since then is
        not lost by news about an older one)."""
        if sid in self.lost or (epoch is not None and self.epochs.get(sid) != epoch):
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

    def refused_locally(self, sid: str, epoch: int | None) -> SessionFenced | None:
        """The error for a write made under ``epoch`` that cannot land, as this node already knows without a round trip:
        the session is lost, or the node no longer holds it at that epoch (closed, or claimed again since: epochs only
        grow, so the row's is past ``epoch`` for good)."""
        why = self.lost.get(sid)
        if why is None and epoch is not None and self.epochs.get(sid) != epoch:
            held = self.epochs.get(sid)
            why = f"made under epoch {epoch}; this node " + (f"holds it at epoch {held}" if held else "let go of it")
        if why is None:
            return None
        self.refusals += 1
        return SessionFenced(sid, why)

    def claims(self, sids: Iterable[str]) -> dict[str, int | None]:
        """The epoch this node holds for each of ``sids`` now (None: none): what a write batch learns it lost."""
        return {sid: self.epochs.get(sid) for sid in sids}


# session id -> (owner node, epoch), as a write batch found the rows
Owners = dict[str, tuple[str | None, int]]


def read_owners(conn: Connection, sids: Iterable[str]) -> Owners:
    """Inside the caller's write transaction: the owner and epoch of each of ``sids`` (rows not there yet are left
    out), with the rows locked until the transaction ends. Synchronous (the store writer runs a whole batch in one
    call, on SQLite on a thread of its own)."""
    ids = sorted(set(sids))
    found: Owners = {}
    for start in range(0, len(ids), 1000):
        rows = conn.execute(_OWNERS, {"ids": ids[start : start + 1000]})
        found.update({sid: (owner, int(epoch)) for sid, owner, epoch in rows})
    return found


def refusal(node_id: str, sid: str, epoch: int | None, owners: Owners) -> SessionFenced | None:
    """Why a write of node ``node_id`` for ``sid``, made under ``epoch``, may not land (None: it may).

    It lands only while the row names this node at exactly that epoch: a write made before the node lost the session
    and claimed it again carries the old epoch, and is refused though the node owns the session now. A write made
    under no claim (``epoch`` None) lands only while no node owns the session. A row not there yet is no one's."""
    found = owners.get(sid)
    if found is None:
        return None
    owner, current = found
    lands = owner is None if epoch is None else (owner == node_id and current == epoch)
    if lands:
        return None
    why = f"owned by {f'node {owner}' if owner is not None else 'no node'} at epoch {current}"
    return SessionFenced(sid, why + (f", not this node at epoch {epoch}" if epoch is not None else ""))


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
        stmt = _node_columns(self.engine.dialect.name)
        if states is not None:
            stmt = stmt.where(n.c.state.in_([st.value for st in states]))
        async with self.engine.connect() as conn:
            owned = {owner: int(count) for owner, count in await conn.execute(counts)}
            rows = (await conn.execute(stmt)).all()
        nodes = [_node_from_row(row, owned.get(row.id, 0)) for row in rows]
        return sorted(nodes, key=lambda node: (node.state != NodeState.LIVE, node.id))

    @whole
    async def register(
        self, me: NodeRecord, *, gone: Iterable[str] = (), conflicts: Callable[[NodeRecord], bool]
    ) -> list[NodeRecord]:
        """Register ``me`` as live, unless a live node for which ``conflicts`` is true holds a lease: those are
        returned and nothing is written. Nodes whose lease passed, and those of ``gone`` (known dead), are marked
        dead first. Sessions the database says ``me`` owns (a previous run with the same id) are let go of.

        The lease lasts from ``me.heartbeat_at`` to ``me.lease_until``, from now on the database's clock."""
        lease_s = (me.lease_until - me.heartbeat_at).total_seconds()
        n = m.nodes
        conn = await self._begin()
        try:
            async with conn.begin():
                await self._lock(conn)
                await self._bury(conn, me.id, gone)
                others = _node_columns(conn.dialect.name).where(n.c.state.in_(_LEASED), n.c.id != me.id)
                rows = (await conn.execute(others)).all()
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
                    "incarnation": me.incarnation,
                }
                d = conn.dialect.name
                await conn.execute(sa.delete(n).where(n.c.id == me.id))
                await conn.execute(sa.insert(n).values(heartbeat_at=db_now(d), lease_until=db_now(d, lease_s)), row)
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

    async def _bury(self, conn: AsyncConnection, me: str, gone: Iterable[str]) -> None:
        n = m.nodes
        expired = sa.or_(n.c.lease_until < db_now(conn.dialect.name), n.c.id.in_(list(gone)))
        await conn.execute(
            sa.update(n).where(n.c.state.in_(_LEASED), n.c.id != me, expired).values(state=NodeState.DEAD)
        )

    async def live_url(self, node_id: str) -> str | None:
        """The address of ``node_id`` while it holds its lease (live or draining), else None."""
        n = m.nodes
        leased = n.c.lease_until >= db_now(self.engine.dialect.name)
        stmt = sa.select(n.c.url).where(n.c.id == node_id, n.c.state.in_(_LEASED), leased)
        async with self.engine.connect() as conn:
            return (await conn.execute(stmt)).scalar()

    async def next_expiry_in(self, node_id: str) -> float | None:
        """Seconds until the first lease of the other nodes holding one passes, on the database's clock (None: no
        other such node): a node that died is found dead then, not a polling interval later."""
        n = m.nodes
        first = seconds_until(self.engine.dialect.name, sa.func.min(n.c.lease_until))
        stmt = sa.select(first).where(n.c.state.in_(_LEASED), n.c.id != node_id)
        async with self.engine.connect() as conn:
            left = (await conn.execute(stmt)).scalar()
        return float(left) if left is not None else None

    async def renew(self, node_id: str, lease_s: float) -> bool:
        """Extend this node's lease to ``lease_s`` from now on the database's clock; False when it holds none any more
        (another node buried it)."""
        n = m.nodes
        d = self.engine.dialect.name
        async with self.engine.begin() as conn:
            result = await conn.execute(
                sa.update(n)
                .where(n.c.id == node_id, n.c.state.in_(_LEASED))
                .values(heartbeat_at=db_now(d), lease_until=db_now(d, lease_s))
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

    async def owned_by(self, node_id: str) -> dict[str, int]:
        """The live sessions the database names ``node_id`` the owner of, with their epochs."""
        s = m.sessions
        stmt = sa.select(s.c.id, s.c.owner_epoch).where(s.c.owner_node == node_id, s.c.state.in_(_LIVE))
        async with self.engine.connect() as conn:
            return {sid: int(epoch) for sid, epoch in await conn.execute(stmt)}

    @whole
    async def claim_orphans(self, node_id: str, *, share: bool = False) -> dict[str, int]:
        """Take over live sessions no live node owns (never claimed, or owned by a node that stopped or whose lease
        passed): each one's epoch is incremented and this node named its owner, in one transaction. With ``share``
        it takes only its share: what brings it to an even load among the live nodes (and at least orphans / live
        nodes, rounded up), so the nodes split a dead node's sessions.
        A node whose own lease has passed (or that was buried) takes nothing and buries no one: a claim sent while it
        held its lease may run after it passed (a stalled database, a slow connection), and by then another node may
        have taken its sessions, or be about to take those it would claim. Judged here, in the claim's transaction,
        on the database's clock.
        Returns the sessions taken, with their new epochs."""
        n, s = m.nodes, m.sessions
        conn = await self._begin()
        try:
            async with conn.begin():
                await self._lock(conn)
                mine = sa.select(n.c.id).where(
                    n.c.id == node_id, n.c.state.in_(_LEASED), n.c.lease_until >= db_now(conn.dialect.name)
                )
                if (await conn.execute(mine)).first() is None:
                    return {}
                await self._bury(conn, node_id, ())
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


__all__ = [
    "Fence",
    "NodeMode",
    "NodeRecord",
    "NodeState",
    "Nodes",
    "Owners",
    "SessionFenced",
    "db_now",
    "read_owners",
    "refusal",
    "seconds_until",
]
