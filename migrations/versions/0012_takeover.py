"""An operator's takeover is durable with its session (``sessions.takeover``): who holds it and since when. A session
held when its process stops is held where it runs next, and no reply of the model plays until it is handed back.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _json() -> sa.types.TypeEngine[object]:
    return sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")


def upgrade() -> None:
    op.add_column("sessions", sa.Column("takeover", _json(), nullable=True))


def downgrade() -> None:
    # in place, not batch mode: rebuilding ``sessions`` on SQLite would cascade to every table that refers to it
    op.execute("ALTER TABLE sessions DROP COLUMN takeover")
