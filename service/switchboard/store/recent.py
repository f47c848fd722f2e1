"""What a node reads of the recent past of the sessions it adopts (``Store.load_sessions_bulk``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from ..runtime.tools import ToolStatus
from . import models as m

TOOL_ENDED = "tool.ended"


def recent_events(sids: Sequence[str], types: Sequence[str], limit: int) -> sa.Select[Any]:
    """What a node reads of each of ``sids``' recent past, each session's oldest first: its latest ``limit`` events
    whose type is one of ``types``, except ``tool.ended``, of which only each tool's last end, and only when it failed
    (what the attention tracker learns from the others: that the tool works again). A tool ends at every call, so
    reading them all cost recovery more than the rest of the window together."""
    t = m.events
    columns = (t.c.id, t.c.session_id, t.c.seq, t.c.type, t.c.at, t.c.data)
    others = [name for name in types if name != TOOL_ENDED]
    ranked = (
        sa.select(*columns, _newest_first(t.c.session_id).label("rank"))
        .where(t.c.session_id.in_(list(sids)), t.c.type.in_(others))
        .subquery()
    )
    picked: list[sa.Select[Any]] = [sa.select(*(ranked.c[c.name] for c in columns)).where(ranked.c.rank <= limit)]
    if TOOL_ENDED in types:
        tool = t.c.data["name"].as_string()
        last = (
            sa.select(*columns, _newest_first(t.c.session_id, tool).label("rank"))
            .where(t.c.session_id.in_(list(sids)), t.c.type == TOOL_ENDED)
            .subquery()
        )
        failed = last.c.data["status"].as_string() == ToolStatus.FAILED.value
        picked.append(sa.select(*(last.c[c.name] for c in columns)).where(last.c.rank == 1, failed))
    both = sa.union_all(*picked).subquery()
    return sa.select(*both.c).order_by(both.c.session_id, both.c.seq)


def _newest_first(*partition: sa.ColumnElement[Any]) -> sa.ColumnElement[int]:
    return sa.func.row_number().over(partition_by=partition, order_by=m.events.c.seq.desc())
