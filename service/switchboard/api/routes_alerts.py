"""Alerts: the sessions' reasons for attention sent to the operator's webhook sinks, and how each delivery went."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field

from ..store.alerts import CLEARED, OPENED, AlertRecord, DeliveryState
from .auth import Require
from .deps import HostDep

router = APIRouter(prefix="/v1/alerts", tags=["sessions"])

MAX_ALERTS = 500


class AlertDeliveryRead(BaseModel):
    """One transition of an alert sent to one sink (the sink's name only: its URL is the server's configuration)."""

    sink: str
    transition: Literal["opened", "cleared"]
    state: DeliveryState
    attempts: int
    last_error: str | None = None
    updated_at: datetime | None = None


class AlertRead(BaseModel):
    id: str
    session_id: str
    reason: str = Field(description="The attention reason's code (`tool_failed`, `silence_after_input`, ...).")
    agent: str
    message: str
    since: datetime = Field(description="When the reason began.")
    opened_at: datetime
    cleared_at: datetime | None = Field(description="When the reason cleared; null while the alert is open.")
    deliveries: list[AlertDeliveryRead]


class AlertList(BaseModel):
    items: list[AlertRead]


def _read(alert: AlertRecord) -> AlertRead:
    deliveries = [
        AlertDeliveryRead(sink=sink, transition=kind, **d.model_dump())
        for kind in (OPENED, CLEARED)
        for sink, d in sorted(alert.deliveries(kind).items())
    ]
    values = alert.model_dump(include={"id", "session_id", "reason", "agent", "message", "since", "opened_at"})
    return AlertRead(**values, cleared_at=alert.cleared_at, deliveries=deliveries)


@router.get(
    "",
    operation_id="listAlerts",
    response_model=AlertList,
    dependencies=[Depends(Require("sessions:read"))],
)
async def list_alerts(
    host: HostDep,
    state: Annotated[
        Literal["open", "all"], Query(description="`open`: the alerts not cleared; `all`: the cleared ones too.")
    ] = "open",
    session_id: Annotated[str | None, Query(min_length=1, max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_ALERTS)] = 100,
) -> AlertList:
    """The alerts sent to the server's webhook sinks (`SWITCHBOARD_ALERT_SINKS`), newest first: one per session and
    attention reason from the moment the reason appeared until it cleared, each with the state of its deliveries to
    each sink (`pending`, `delivered`, `failed`, `dropped`). The same on every node of a cluster (read from the
    database). Empty when no sink is configured."""
    alerts = await host.store.alerts.listing(include_cleared=state == "all", session_id=session_id, limit=limit)
    return AlertList(items=[_read(alert) for alert in alerts])
