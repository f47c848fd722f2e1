"""Text round-trips exactly: the store now encodes NUL and lone surrogates with an escape character (U+E000), so
that character, where rows already hold it, is escaped too (U+E000 becomes U+E000 "e"), or it would be read back as
the start of an escape.

Free text and JSON columns only: ids, names and states are generated or validated and never hold it.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (table, column, is JSON)
COLUMNS = (
    ("sessions", "config", True),
    ("sessions", "metadata", True),
    ("sessions", "llm_state", True),
    ("chat_items", "data", True),
    ("tool_calls", "arguments", True),
    ("tool_calls", "progress", True),
    ("tool_calls", "output", False),
    ("speeches", "text", False),
    ("speeches", "played_text", False),
    ("events", "data", True),
    ("idempotency_keys", "response_body", True),
)


def _rewrite(old: str, new: str) -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    for table, column, is_json in COLUMNS:
        if postgres:
            value = f'"{column}"::text' if is_json else f'"{column}"'
            replaced = f"replace({value}, {old}, {new})" + ("::jsonb" if is_json else "")
            op.execute(f'UPDATE {table} SET "{column}" = {replaced} WHERE strpos({value}, {old}) > 0')
        else:
            op.execute(
                f'UPDATE {table} SET "{column}" = replace("{column}", {old}, {new}) WHERE instr("{column}", {old})'
            )


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _rewrite("chr(57344)", "chr(57344) || 'e'")
    else:
        _rewrite("char(57344)", "char(57344) || 'e'")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _rewrite("chr(57344) || 'e'", "chr(57344)")
    else:
        _rewrite("char(57344) || 'e'", "char(57344)")
