"""Each event names what it reports: ``events.subject`` holds the chat item id of a ``chat.item``, the call id of a
``tool.ended`` and the speech id of a ``speech.done`` (NULL for other events). Recovery reads it, for every live
session at once, to find durable changes a crash left without their event, without parsing each event's JSON.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("events", sa.Column("subject", sa.String(), nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        paths = {
            "chat.item": "data #>> '{item,id}'",
            "tool.ended": "data ->> 'call_id'",
            "speech.done": "data ->> 'speech_id'",
        }
    else:
        paths = {
            "chat.item": "json_extract(data, '$.item.id')",
            "tool.ended": "json_extract(data, '$.call_id')",
            "speech.done": "json_extract(data, '$.speech_id')",
        }
    for event_type, path in paths.items():
        op.execute(f"UPDATE events SET subject = {path} WHERE type = '{event_type}'")


def downgrade() -> None:
    with op.batch_alter_table("events") as batch:
        batch.drop_column("subject")
