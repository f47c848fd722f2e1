"""The schema, as SQLAlchemy Core tables. Alembic owns the DDL (migrations/versions); a test checks they agree."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Dialect

from ..runtime.status import LIVE_STATUSES
from .text import String, Text


class TZDateTime(sa.TypeDecorator[datetime]):
    """A timezone-aware timestamp, stored and returned in UTC on every dialect.

    SQLite has no timestamp type: values are stored as UTC text and come back naive, so they are re-tagged here.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: timestamps must be timezone-aware")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def json_type() -> sa.types.TypeEngine[Any]:
    """JSON, as JSONB on PostgreSQL. ``None`` is stored as SQL NULL."""
    return sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")


# A bigint primary key that still autoincrements on SQLite (only INTEGER PRIMARY KEY aliases the rowid there).
BigIntPK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
    }
)


def _session_fk() -> sa.ForeignKey:
    return sa.ForeignKey("sessions.id", ondelete="CASCADE")


sessions = sa.Table(
    "sessions",
    metadata,
    sa.Column("id", String(), primary_key=True),
    sa.Column("agent", String(), nullable=False),
    sa.Column("state", String(), nullable=False),
    sa.Column("config", json_type(), nullable=False),
    sa.Column("metadata", json_type(), nullable=False),
    sa.Column("llm_state", json_type(), nullable=True),
    sa.Column("current_speech_id", String(), nullable=True),
    # its agent's on_enter has run; false while it is owed (a session created or handed off as its process stopped)
    sa.Column("entered", sa.Boolean(), nullable=False, server_default=sa.true()),
    sa.Column("takeover", json_type(), nullable=True),  # the operator who holds it (``runtime.takeover``)
    sa.Column("created_at", TZDateTime(), nullable=False),
    sa.Column("updated_at", TZDateTime(), nullable=False),
    # Ownership (fencing): the node running the session, and the epoch its writes must find here. A node that takes
    # a session over increments the epoch, so the writes of the node it took it from are refused from then on.
    sa.Column("owner_node", String(), nullable=True),
    sa.Column("owner_epoch", sa.BigInteger(), nullable=False, server_default="0"),
    sa.Index(None, "state"),
    sa.Index(None, "created_at", "id"),
    sa.Index(None, "owner_node"),
)
# Who created a session (``config.owner``) as PostgreSQL reads it, and the live states, both in literals: a query
# made of them matches the index below in any plan, a generic one included.
SESSION_OWNER = sessions.c.config.op("->>", return_type=sa.Text())(sa.literal_column("'owner'"))
SESSION_LIVE = sessions.c.state.in_([sa.literal_column(f"'{state.value}'") for state in sorted(LIVE_STATUSES)])
# The live sessions of each creator, which a quota counted in the database reads (cluster mode: PostgreSQL only).
sa.Index("ix_sessions_live_owner", SESSION_OWNER, postgresql_where=SESSION_LIVE)

# The running instances (nodes) and their leases. A node renews ``lease_until`` while it is alive; one whose lease has
# passed is dead to the others, and its sessions may be taken over (their epoch incremented).
nodes = sa.Table(
    "nodes",
    metadata,
    sa.Column("id", String(), primary_key=True),
    sa.Column("url", String(), nullable=False),
    sa.Column("state", String(), nullable=False),
    sa.Column("mode", String(), nullable=False),  # "single" or "cluster"
    sa.Column("hostname", String(), nullable=False),
    sa.Column("pid", sa.Integer(), nullable=False),
    sa.Column("started_at", TZDateTime(), nullable=False),
    sa.Column("heartbeat_at", TZDateTime(), nullable=False),
    sa.Column("lease_until", TZDateTime(), nullable=False),
    # The process that registered the row (a fresh value per process): a node restarted with the same id is another
    # incarnation, so what the previous process held (an idempotency reservation) is not held by the new one.
    sa.Column("incarnation", String(), nullable=True),
    sa.Index(None, "state"),
)

# Append-only. ``pos`` is the per-session insertion sequence (0, 1, 2, ...): the order is a view built from it.
chat_items = sa.Table(
    "chat_items",
    metadata,
    sa.Column("session_id", String(), _session_fk(), primary_key=True),
    sa.Column("pos", sa.BigInteger(), primary_key=True, autoincrement=False),
    sa.Column("item_id", String(), nullable=False),
    sa.Column("type", String(), nullable=False),
    sa.Column("call_id", String(), nullable=True),
    sa.Column("created_at", TZDateTime(), nullable=False),
    sa.Column("data", json_type(), nullable=False),
    sa.UniqueConstraint("session_id", "item_id"),
    sa.Index(None, "session_id", "call_id"),
    sa.Index(None, "session_id", "type"),
    sa.Index(None, "session_id", "created_at"),
)

tool_calls = sa.Table(
    "tool_calls",
    metadata,
    sa.Column("session_id", String(), _session_fk(), primary_key=True),
    sa.Column("call_id", String(), primary_key=True),
    sa.Column("name", String(), nullable=False),
    sa.Column("status", String(), nullable=False),
    sa.Column("arguments", json_type(), nullable=False),
    sa.Column("progress", json_type(), nullable=False),
    sa.Column("output", Text(), nullable=True),
    sa.Column("is_error", sa.Boolean(), nullable=False),
    sa.Column("error", Text(), nullable=True),
    sa.Column("cancellable", sa.Boolean(), nullable=False),
    sa.Column("scope", String(), nullable=False),
    sa.Column("background", sa.Boolean(), nullable=False),
    sa.Column("speech_id", String(), nullable=True),
    sa.Column("agent", String(), nullable=True),
    sa.Column("speculative", sa.Boolean(), nullable=False, server_default=sa.false()),
    sa.Column("started_at", TZDateTime(), nullable=False),
    sa.Column("ended_at", TZDateTime(), nullable=True),
    sa.Index(None, "status", "started_at"),
)

speeches = sa.Table(
    "speeches",
    metadata,
    sa.Column("session_id", String(), _session_fk(), primary_key=True),
    sa.Column("id", String(), primary_key=True),
    sa.Column("source", String(), nullable=False),
    sa.Column("state", String(), nullable=False),
    sa.Column("interrupted", sa.Boolean(), nullable=False),
    sa.Column("allow_interruptions", sa.Boolean(), nullable=False),
    sa.Column("text", Text(), nullable=False),
    sa.Column("played_text", Text(), nullable=False),
    sa.Column("created_at", TZDateTime(), nullable=False),
    sa.Column("prompt_tokens", sa.Integer(), nullable=False, server_default="0"),
    sa.Column("completion_tokens", sa.Integer(), nullable=False, server_default="0"),
)

# Operator commands scheduled for a point of the conversation, and coaching notes for the next model request
# (``runtime.pending.PendingCommand``): ``data`` is the full record; ``state`` pending until applied or cancelled.
pending_commands = sa.Table(
    "pending_commands",
    metadata,
    sa.Column("session_id", String(), _session_fk(), primary_key=True),
    sa.Column("id", String(), primary_key=True),
    sa.Column("kind", String(), nullable=False),
    sa.Column("state", String(), nullable=False),
    sa.Column("created_at", TZDateTime(), nullable=False),
    sa.Column("data", json_type(), nullable=False),
    sa.Index(None, "session_id", "state"),
)

# ``id`` is a global, monotonic cursor for the multi-session dashboard stream; (session_id, seq) is the log key.
# It is the primary key (not (session_id, seq)) because SQLite can only autoincrement an INTEGER PRIMARY KEY.
events = sa.Table(
    "events",
    metadata,
    sa.Column("id", BigIntPK, primary_key=True, autoincrement=True),
    sa.Column("session_id", String(), _session_fk(), nullable=False),
    sa.Column("seq", sa.BigInteger(), nullable=False),
    sa.Column("type", String(), nullable=False),
    sa.Column("at", TZDateTime(), nullable=False),
    sa.Column("data", json_type(), nullable=False),
    # What the event reports, for the events recovery checks (``runtime.ports.Reported``); NULL for the others.
    sa.Column("subject", String(), nullable=True),
    sa.UniqueConstraint("session_id", "seq"),
    sa.Index(None, "session_id", "type"),
    sqlite_autoincrement=True,  # never reuse an id: dashboard cursors rely on ids only growing
)

# One row per (key, scope): a reservation (``pending``, held by one process: ``holder_node`` at its
# ``holder_incarnation``) taken before the command runs, completed (``done``, with the answer) in the transaction of
# the command's effect. The primary key makes the reservation unique across every node.
idempotency_keys = sa.Table(
    "idempotency_keys",
    metadata,
    sa.Column("key", String(), primary_key=True),
    sa.Column("scope", String(), primary_key=True),
    sa.Column("request_hash", String(), nullable=False),
    sa.Column("status_code", sa.Integer(), nullable=False),  # 0 while pending
    sa.Column("response_body", json_type(), nullable=True),
    sa.Column("created_at", TZDateTime(), nullable=False),
    sa.Column("state", String(), nullable=False, server_default="done"),
    sa.Column("holder_node", String(), nullable=True),
    sa.Column("holder_incarnation", String(), nullable=True),
    sa.Index(None, "created_at"),
)

# One row per alert: a session's reason for attention (``reason``, a code) from the moment it was opened to the moment
# it cleared. At most one open alert per session and reason (the partial unique index): whichever node opens it first
# is the one that delivers it, and a node that adopts the session finds it open. Each transition's deliveries (sink
# name -> status) are kept with it, with the node that owes them while some are not final (``outstanding``).
alerts = sa.Table(
    "alerts",
    metadata,
    sa.Column("id", String(), primary_key=True),
    sa.Column("session_id", String(), _session_fk(), nullable=False),
    sa.Column("reason", String(), nullable=False),
    sa.Column("agent", String(), nullable=False),
    sa.Column("message", Text(), nullable=False),
    sa.Column("since", TZDateTime(), nullable=False),
    sa.Column("opened_at", TZDateTime(), nullable=False),
    sa.Column("opened_node", String(), nullable=True),
    sa.Column("opened_deliveries", json_type(), nullable=False),
    sa.Column("cleared_at", TZDateTime(), nullable=True),
    sa.Column("cleared_node", String(), nullable=True),
    sa.Column("cleared_deliveries", json_type(), nullable=True),
    sa.Column("outstanding", sa.Boolean(), nullable=False, server_default=sa.false()),
    sa.Index(None, "session_id"),
    sa.Index(None, "outstanding"),
    sa.Index(
        "ix_alerts_open",
        "session_id",
        "reason",
        unique=True,
        postgresql_where=sa.text("cleared_at IS NULL"),
        sqlite_where=sa.text("cleared_at IS NULL"),
    ),
)
