"""The durable state the checker reads at the end: the tables of the run's database, as plain rows."""

from __future__ import annotations

import json
from typing import Any

import asyncpg

Row = dict[str, Any]
TABLES = {
    "sessions": "SELECT id, agent, state, metadata, owner_node, owner_epoch FROM sessions",
    "chat_items": "SELECT session_id, pos, item_id, type, call_id, data FROM chat_items ORDER BY session_id, pos",
    "tool_calls": "SELECT session_id, call_id, name, status, background, speech_id, output FROM tool_calls",
    "speeches": "SELECT session_id, id, source, state, interrupted, text FROM speeches",
    "events": "SELECT id, session_id, seq, type, data, extract(epoch FROM at) AS at FROM events ORDER BY id",
    "idempotency_keys": "SELECT key, scope, status_code FROM idempotency_keys",
    "nodes": "SELECT id, state, lease_until > now() AS leased FROM nodes",
}
JSON_COLUMNS = ("metadata", "data")


def _plain(record: asyncpg.Record) -> Row:
    row = dict(record)
    for column in JSON_COLUMNS:
        if isinstance(row.get(column), str):
            row[column] = json.loads(row[column])
    if "at" in row and row["at"] is not None:
        row["at"] = float(row["at"])
    return row


async def read_durable(dsn: str) -> dict[str, list[Row]]:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        return {table: [_plain(r) for r in await conn.fetch(query)] for table, query in TABLES.items()}
    finally:
        await conn.close()
