"""What a session owes, durable for whoever runs it next:

- ``sessions.entered``: its agent's ``on_enter`` has run. One owed (a session created, or handed off to another agent,
  just as its process stopped) runs where the session runs next, and one that ran never runs twice.
- ``events.subject`` also names the chat item of a ``user.input`` and the speech of a ``speech.created``, so that
  recovery finds input and speeches a crash left durable without their event (as 0004 did for ``chat.item``,
  ``tool.ended`` and ``speech.done``), filled in here for the events already stored.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SUBJECTS = {"user.input": "item_id", "speech.created": "speech_id"}


def upgrade() -> None:
    op.add_column("sessions", sa.Column("entered", sa.Boolean(), nullable=False, server_default=sa.true()))
    postgresql = op.get_bind().dialect.name == "postgresql"
    for event_type, field in _SUBJECTS.items():
        path = f"data ->> '{field}'" if postgresql else f"json_extract(data, '$.{field}')"
        op.execute(f"UPDATE events SET subject = {path} WHERE type = '{event_type}'")


def downgrade() -> None:
    types = ", ".join(f"'{t}'" for t in _SUBJECTS)
    op.execute(f"UPDATE events SET subject = NULL WHERE type IN ({types})")
    # in place, not batch mode: rebuilding ``sessions`` on SQLite would cascade to every table that refers to it
    op.execute("ALTER TABLE sessions DROP COLUMN entered")
