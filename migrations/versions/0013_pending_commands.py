"""Pending commands: operator commands scheduled for a point of the conversation (input, say, interrupt: when the
session is next idle, after the current speech, after a named tool call) and coaching notes for the agent's next model
request. Each row is the command's full record (``data``), durable from its acceptance until it is applied (in the
transaction of its effect) or cancelled, so that a drain or a failover never loses one.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "pending_commands",
        sa.Column("session_id", sa.String(), nullable=False),
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "data",
            sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("session_id", "id", name="pk_pending_commands"),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.id"], name="fk_pending_commands_session_id_sessions", ondelete="CASCADE"
        ),
    )
    op.create_index("ix_pending_commands_session_id_state", "pending_commands", ["session_id", "state"])


def downgrade() -> None:
    op.drop_index("ix_pending_commands_session_id_state", table_name="pending_commands")
    op.drop_table("pending_commands")
