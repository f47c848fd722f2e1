"""Ownership with fencing: a ``nodes`` table (each running instance, its lease), and per session the node that owns
it and the ownership ``epoch`` that every write of the session checks in its own transaction.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _tz() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "nodes",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("url", sa.String(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("mode", sa.String(), nullable=False),
        sa.Column("hostname", sa.String(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("started_at", _tz(), nullable=False),
        sa.Column("heartbeat_at", _tz(), nullable=False),
        sa.Column("lease_until", _tz(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_nodes"),
    )
    op.create_index("ix_nodes_state", "nodes", ["state"])
    op.add_column("sessions", sa.Column("owner_node", sa.String(), nullable=True))
    op.add_column("sessions", sa.Column("owner_epoch", sa.BigInteger(), nullable=False, server_default="0"))
    op.create_index("ix_sessions_owner_node", "sessions", ["owner_node"])


def downgrade() -> None:
    op.drop_index("ix_sessions_owner_node", table_name="sessions")
    # in place, not batch mode: rebuilding ``sessions`` on SQLite would cascade to every table that refers to it
    for column in ("owner_epoch", "owner_node"):
        op.execute(f"ALTER TABLE sessions DROP COLUMN {column}")
    op.drop_index("ix_nodes_state", table_name="nodes")
    op.drop_table("nodes")
