"""Whether a session's agent has entered (its ``on_enter`` ran): one owed (a session created, or handed off to
another agent, just as its process stopped) runs where the session runs next, and one that ran never runs twice.

Revision ID: 0009
Revises: 0007
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("sessions", sa.Column("entered", sa.Boolean(), nullable=False, server_default=sa.true()))


def downgrade() -> None:
    # in place, not batch mode: rebuilding ``sessions`` on SQLite would cascade to every table that refers to it
    op.execute("ALTER TABLE sessions DROP COLUMN entered")
