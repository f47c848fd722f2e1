"""Idempotency reservations: a key is reserved (``pending``, naming the process that holds it) before its command
runs, and completed (``done``) in the transaction of the command's effect. Every record written before is ``done``.
Nodes record their process incarnation, so a node restarted with the same id does not hold its predecessor's
reservations.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("idempotency_keys", sa.Column("state", sa.String(), nullable=False, server_default="done"))
    op.add_column("idempotency_keys", sa.Column("holder_node", sa.String(), nullable=True))
    op.add_column("idempotency_keys", sa.Column("holder_incarnation", sa.String(), nullable=True))
    op.add_column("nodes", sa.Column("incarnation", sa.String(), nullable=True))


def downgrade() -> None:
    # a reservation is no record: the code before this revision would replay its placeholder answer
    op.execute("DELETE FROM idempotency_keys WHERE state = 'pending'")
    # in place, not batch mode (as 0006): SQLite drops a column since 3.35
    op.execute("ALTER TABLE nodes DROP COLUMN incarnation")
    for column in ("holder_incarnation", "holder_node", "state"):
        op.execute(f"ALTER TABLE idempotency_keys DROP COLUMN {column}")
