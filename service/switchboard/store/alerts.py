"""The SQL of the ``alerts`` table: alerts opened and cleared once across every node, and their deliveries.

An alert is opened by inserting it: the partial unique index (one open alert per session and reason) lets exactly one
node win, whatever nodes race or restart. It is cleared by a conditional update (``cleared_at IS NULL``): exactly one
node wins that too. The winner of a transition owes its deliveries (``opened_node``, ``cleared_node``) until each is
final; a node that finds the owing node gone takes them over (``claim_orphaned``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from pydantic import BaseModel, Field
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ..runtime.status import ENDED_STATUSES
from . import models as m
from .engine import IMMEDIATE, whole

OPENED = "opened"
CLEARED = "cleared"
_ENDED = tuple(sorted(s.value for s in ENDED_STATUSES))  # over for good (a session being moved is not)


class DeliveryState(StrEnum):
    PENDING = "pending"  # queued, or waiting for its next attempt
    DELIVERED = "delivered"  # the sink answered 2xx
    FAILED = "failed"  # every attempt failed
    DROPPED = "dropped"  # the sink's queue was full: the oldest waiting delivery made room


class Delivery(BaseModel):
    """One transition of one alert sent to one sink."""

    state: DeliveryState = DeliveryState.PENDING
    attempts: int = 0
    last_error: str | None = None
    updated_at: datetime | None = None

    @property
    def final(self) -> bool:
        return self.state != DeliveryState.PENDING


class AlertRecord(BaseModel):
    id: str
    session_id: str
    reason: str
    agent: str
    message: str
    since: datetime
    opened_at: datetime
    opened_node: str | None = None
    opened_deliveries: dict[str, Delivery] = Field(default_factory=dict)
    cleared_at: datetime | None = None
    cleared_node: str | None = None
    cleared_deliveries: dict[str, Delivery] | None = None

    def deliveries(self, kind: str) -> dict[str, Delivery]:
        return self.opened_deliveries if kind == OPENED else (self.cleared_deliveries or {})

    @property
    def outstanding(self) -> bool:
        every = [*self.opened_deliveries.values(), *(self.cleared_deliveries or {}).values()]
        return any(not d.final for d in every)


def _dump(deliveries: dict[str, Delivery] | None) -> dict[str, Any] | None:
    if deliveries is None:
        return None
    return {sink: d.model_dump(mode="json") for sink, d in deliveries.items()}


def _from_row(row: Any) -> AlertRecord:
    values = dict(row._mapping)
    values.pop("outstanding", None)
    return AlertRecord.model_validate(values)


class Alerts:
    """Each method is its own transaction; a write runs to its end even when its caller is cancelled (``whole``)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def _begin(self) -> AsyncConnection:
        conn = await self.engine.connect()
        if conn.dialect.name == "sqlite":  # take the write lock at BEGIN: no upgrade from a read lock to fail
            conn = await conn.execution_options(**{IMMEDIATE: True})
        return conn

    @whole
    async def open(self, alert: AlertRecord) -> bool:
        """Insert ``alert``; False when the session already has an open alert for its reason (another node's, or
        this node's before a restart) or no longer exists."""
        values = alert.model_dump()
        values["opened_deliveries"] = _dump(alert.opened_deliveries)
        values["cleared_deliveries"] = _dump(alert.cleared_deliveries)
        values["outstanding"] = alert.outstanding
        conn = await self._begin()
        try:
            async with conn.begin():
                await conn.execute(sa.insert(m.alerts).values(**values))
        except IntegrityError:
            return False
        finally:
            await conn.close()
        return True

    @whole
    async def clear(
        self, alert_id: str, *, node: str, at: datetime, deliveries: dict[str, Delivery]
    ) -> AlertRecord | None:
        """Mark an open alert cleared by ``node``; None when it was cleared already (by any node)."""
        a = m.alerts
        stmt = (
            sa.update(a)
            .where(a.c.id == alert_id, a.c.cleared_at.is_(None))
            .values(cleared_at=at, cleared_node=node, cleared_deliveries=_dump(deliveries))
            .returning(*a.c)
        )
        conn = await self._begin()
        try:
            async with conn.begin():
                row = (await conn.execute(stmt)).first()
                if row is None:
                    return None
                found = _from_row(row)
                await conn.execute(sa.update(a).where(a.c.id == alert_id).values(outstanding=found.outstanding))
        finally:
            await conn.close()
        return found

    @whole
    async def record(self, alert_id: str, kind: str, deliveries: dict[str, Delivery]) -> None:
        """Store the deliveries of one transition of an alert (the other's are left as they are)."""
        a = m.alerts
        column = a.c.opened_deliveries if kind == OPENED else a.c.cleared_deliveries
        conn = await self._begin()
        try:
            async with conn.begin():
                row = (await conn.execute(sa.select(a).where(a.c.id == alert_id).with_for_update())).first()
                if row is None:
                    return
                found = _from_row(row)
                if kind == OPENED:
                    found.opened_deliveries = deliveries
                else:
                    found.cleared_deliveries = deliveries
                update = {column.name: _dump(deliveries), "outstanding": found.outstanding}
                await conn.execute(sa.update(a).where(a.c.id == alert_id).values(**update))
        finally:
            await conn.close()

    async def open_for(self, session_ids: Iterable[str]) -> list[AlertRecord]:
        """The open alerts of these sessions."""
        ids = sorted(set(session_ids))
        if not ids:
            return []
        a = m.alerts
        stmt = sa.select(a).where(a.c.cleared_at.is_(None), a.c.session_id.in_(ids))
        async with self.engine.connect() as conn:
            return [_from_row(row) for row in await conn.execute(stmt)]

    async def open_of_ended(self, *, keep_failed_since: datetime, limit: int = 100) -> list[AlertRecord]:
        """Open alerts whose session is no longer live: every one of a closed session, and those of a failed one but
        its ``session_failed`` alert, which stays open until ``keep_failed_since``."""
        a, s = m.alerts, m.sessions
        ended = sa.select(s.c.id, s.c.state).where(s.c.state.in_(_ENDED)).subquery()
        stmt = (
            sa.select(a)
            .join(ended, ended.c.id == a.c.session_id)
            .where(a.c.cleared_at.is_(None))
            .where(
                sa.or_(
                    ended.c.state != "failed",
                    a.c.reason != "session_failed",
                    a.c.opened_at < keep_failed_since,
                )
            )
            .order_by(a.c.opened_at)
            .limit(limit)
        )
        async with self.engine.connect() as conn:
            return [_from_row(row) for row in await conn.execute(stmt)]

    async def outstanding(self, *, limit: int = 100) -> list[AlertRecord]:
        """Alerts with a delivery not final yet, oldest first."""
        a = m.alerts
        stmt = sa.select(a).where(a.c.outstanding.is_(True)).order_by(a.c.opened_at).limit(limit)
        async with self.engine.connect() as conn:
            return [_from_row(row) for row in await conn.execute(stmt)]

    @whole
    async def take_over(self, alert_id: str, kind: str, *, gone: str | None, node: str) -> bool:
        """Make ``node`` owe the deliveries of ``kind`` that ``gone`` owed; False when another node took them first."""
        a = m.alerts
        column = a.c.opened_node if kind == OPENED else a.c.cleared_node
        owed = column.is_(None) if gone is None else column == gone
        stmt = sa.update(a).where(a.c.id == alert_id, owed).values({column.name: node})
        conn = await self._begin()
        try:
            async with conn.begin():
                return bool((await conn.execute(stmt)).rowcount)
        finally:
            await conn.close()

    async def listing(
        self, *, include_cleared: bool = False, session_id: str | None = None, limit: int = 100
    ) -> list[AlertRecord]:
        """Alerts newest first: the open ones, or (``include_cleared``) the cleared ones too."""
        a = m.alerts
        stmt = sa.select(a).order_by(a.c.opened_at.desc(), a.c.id).limit(limit)
        if not include_cleared:
            stmt = stmt.where(a.c.cleared_at.is_(None))
        if session_id is not None:
            stmt = stmt.where(a.c.session_id == session_id)
        async with self.engine.connect() as conn:
            return [_from_row(row) for row in await conn.execute(stmt)]


def leased_nodes(rows: Sequence[Any]) -> set[str]:
    """The ids of the nodes holding a lease, from ``Nodes.list_nodes``."""
    return {node.id for node in rows if node.leased}
