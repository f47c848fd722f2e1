"""Initial schema: sessions, chat_items, tool_calls, speeches, events, idempotency_keys.

Revision ID: 0001
Revises:
Create Date: 2024-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _json() -> sa.types.TypeEngine[object]:
    return sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")


def _ts() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def _session_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        ["session_id"], ["sessions.id"], name=f"fk_{table}_session_id_sessions", ondelete="CASCADE"
    )


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("agent", sa.String(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("config", _json(), nullable=False),
        sa.Column("metadata", _json(), nullable=False),
        sa.Column("llm_state", _json(), nullable=True),
        sa.Column("current_speech_id", sa.String(), nullable=True),
        sa.Column("created_at", _ts(), nullable=False),
        sa.Column("updated_at", _ts(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_sessions"),
    )
    op.create_index("ix_sessions_state", "sessions", ["state"])
    op.create_index("ix_sessions_created_at_id", "sessions", ["created_at", "id"])

    op.create_table(
        "chat_items",
        sa.Column("session_id", sa.String(), nullable=False),
        sa.Column("pos", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("item_id", sa.String(), nullable=False),
        sa.Column("type", sa.String(), nullable=False),
        sa.Column("call_id", sa.String(), nullable=True),
        sa.Column("created_at", _ts(), nullable=False),
        sa.Column("data", _json(), nullable=False),
        sa.PrimaryKeyConstraint("session_id", "pos", name="pk_chat_items"),
        sa.UniqueConstraint("session_id", "item_id", name="uq_chat_items_session_id_item_id"),
        _session_fk("chat_items"),
    )
    op.create_index("ix_chat_items_session_id_call_id", "chat_items", ["session_id", "call_id"])
    op.create_index("ix_chat_items_session_id_type", "chat_items", ["session_id", "type"])
    op.create_index("ix_chat_items_session_id_created_at", "chat_items", ["session_id", "created_at"])

    op.create_table(
        "tool_calls",
        sa.Column("session_id", sa.String(), nullable=False),
        sa.Column("call_id", sa.String(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("arguments", _json(), nullable=False),
        sa.Column("progress", _json(), nullable=False),
        sa.Column("output", sa.Text(), nullable=True),
        sa.Column("is_error", sa.Boolean(), nullable=False),
        sa.Column("cancellable", sa.Boolean(), nullable=False),
        sa.Column("scope", sa.String(), nullable=False),
        sa.Column("background", sa.Boolean(), nullable=False),
        sa.Column("speech_id", sa.String(), nullable=True),
        sa.Column("agent", sa.String(), nullable=True),
        sa.Column("started_at", _ts(), nullable=False),
        sa.Column("ended_at", _ts(), nullable=True),
        sa.PrimaryKeyConstraint("session_id", "call_id", name="pk_tool_calls"),
        _session_fk("tool_calls"),
    )
    op.create_index("ix_tool_calls_status_started_at", "tool_calls", ["status", "started_at"])

    op.create_table(
        "speeches",
        sa.Column("session_id", sa.String(), nullable=False),
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("source", sa.String(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("interrupted", sa.Boolean(), nullable=False),
        sa.Column("allow_interruptions", sa.Boolean(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("played_text", sa.Text(), nullable=False),
        sa.Column("created_at", _ts(), nullable=False),
        sa.PrimaryKeyConstraint("session_id", "id", name="pk_speeches"),
        _session_fk("speeches"),
    )

    op.create_table(
        "events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("session_id", sa.String(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("type", sa.String(), nullable=False),
        sa.Column("at", _ts(), nullable=False),
        sa.Column("data", _json(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_events"),
        sa.UniqueConstraint("session_id", "seq", name="uq_events_session_id_seq"),
        _session_fk("events"),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_events_session_id_type", "events", ["session_id", "type"])

    op.create_table(
        "idempotency_keys",
        sa.Column("key", sa.String(), nullable=False),
        sa.Column("scope", sa.String(), nullable=False),
        sa.Column("request_hash", sa.String(), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=False),
        sa.Column("response_body", _json(), nullable=True),
        sa.Column("created_at", _ts(), nullable=False),
        sa.PrimaryKeyConstraint("key", "scope", name="pk_idempotency_keys"),
    )
    op.create_index("ix_idempotency_keys_created_at", "idempotency_keys", ["created_at"])


def downgrade() -> None:
    op.drop_table("idempotency_keys")
    op.drop_table("events")
    op.drop_table("speeches")
    op.drop_table("tool_calls")
    op.drop_table("chat_items")
    op.drop_table("sessions")
