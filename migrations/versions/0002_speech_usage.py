"""Token usage per speech: prompt and completion tokens, summed over the speech's generation steps.

Revision ID: 0002
Revises: 0001
Create Date: 2024-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("speeches", sa.Column("prompt_tokens", sa.Integer(), nullable=False, server_default="0"))
    op.add_column("speeches", sa.Column("completion_tokens", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    # batch mode: SQLite rebuilds the table where it cannot drop a column in place
    with op.batch_alter_table("speeches") as batch:
        batch.drop_column("completion_tokens")
        batch.drop_column("prompt_tokens")
