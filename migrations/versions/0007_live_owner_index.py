"""An index of the live sessions by creator (``config.owner``): a session quota counted in the database (cluster
mode, so PostgreSQL only) reads only the creator's own live sessions.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_LIVE = sa.text("state IN ('active', 'closing', 'initializing')")


def _postgresql() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def upgrade() -> None:
    if _postgresql():
        op.create_index("ix_sessions_live_owner", "sessions", [sa.text("(config ->> 'owner')")], postgresql_where=_LIVE)


def downgrade() -> None:
    if _postgresql():
        op.drop_index("ix_sessions_live_owner", table_name="sessions")
